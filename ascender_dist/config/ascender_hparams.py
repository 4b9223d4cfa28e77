"""Hyper-parameters of ASCender attention (embedded in the YAML config as ``model.ascender``).

Only plain field types (int/float/bool/str/Optional) are used so the project's config system can
build, print and diff this dataclass without knowing anything about attention. Where the seed
(paper, method notes, reference code) disagrees with itself the field below picks a reading; the
choices are explained in ``docs/ascender.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ascender_dist.config.errors import ConfigError, non_finite_field

KERNEL_TAU_FORMS = ("tau", "tau2")
STD_FORMS = ("population", "sample")
OTHER_BIASES = ("none", "alibi")
GATE_PLACEMENTS = ("pre_norm", "post_norm")
NEIGHBOUR_SOURCES = ("affinity", "base_scores")
# floors at which the learned score temperature and density scale are used (AscenderHeadParams):
# nothing else bounds them while they train, and either crossing 0 would invert the softmax or
# Separation's density. 0.01 scales the scores by at most 100x (CLIP also bounds its learned logit
# scale at 100, clamping the stored value after each step; here the forward uses the floor and only
# gradients that would raise a value below it reach it); kappa's floor only keeps
# eta_i = min(1, rho_i / kappa) defined and non-negative.
TAU_SCORE_MIN = 0.01
KAPPA_MIN = 1e-3


@dataclass
class AscenderHParams:
    """Everything that shapes ASCender attention except the per-head learned tensors.

    Field groups: geometry (d_z, d_a), neighbourhoods (k, window, num_global), kernels
    (tau_sep, tau_coh, kernel_tau_form), bias strengths and gates (lambda_*, alpha_*),
    initial values of learned per-head parameters (*_init), schedule, auxiliary losses and
    implementation knobs (chunk_size, eps).
    """

    # --- learned latent geometry (paper section 2) ---
    d_z: int = 32  # latent coordinate dim (z = U x); seed uses head_dim // 2
    d_a: int = 32  # semantic projection dim (h = P x) for the cosine affinity a_ij

    # --- neighbourhoods (sections 2 and 9) ---
    k: int = 16  # semantic top-k neighbours N_k(i), j != i
    window: int = 128  # 0: candidates are all (visible) j; >0: |i-j| <= window, plus globals
    num_global: int = 4  # positions 0..g-1 are candidates for every row (windowed mode only)
    # what N_k(i) ranks: "affinity" the cosine a_ij = hhat_i . hhat_j (section 2, pseudocode);
    # "base_scores" the base attention scores q_i . k_j / sqrt(d), i.e. the neighbours are reused
    # from the attention itself (section 9 "reuse top-k neighbours", section 12, ablation (v))
    neighbour_source: str = "affinity"

    # --- kernels and score temperature ---
    tau_sep: float = 1.0
    tau_coh: float = 1.0
    kernel_tau_form: str = "tau"  # "tau": exp(-d^2/tau) (paper, seed code); "tau2": exp(-d^2/tau^2) (notes)
    tau_score_init: float = 1.0  # A = softmax(S / tau_score), per head

    # --- bias strengths (per head, initial values) and gates ---
    lambda_align: float = 1.0
    lambda_sep: float = 1.0
    lambda_coh: float = 1.0
    trainable_lambdas: bool = False
    # gamma(i) = sigmoid(-alpha * Var): with alpha >= 0 more neighbourhood variance -> weaker bias,
    # which is what the paper's text says (the paper's sigmoid(+alpha * Var) says the opposite).
    alpha_align: float = 1.0
    alpha_coh: float = 1.0
    # "pre_norm": paper-literal, gates and lambdas multiply beta before the row normalisation
    # (they then cancel up to eps); "post_norm": they scale the normalised bias.
    gate_placement: str = "pre_norm"

    # --- separation ---
    delta_init: float = 0.2  # redundancy threshold on a_ij
    kappa_init: float = 32.0  # density scale, eta_i = min(1, rho_i / kappa)
    trainable_delta_kappa_temp: bool = True  # delta, kappa, tau_score learned (seed code) or fixed

    # --- mixing weights omega_* (learned, per head or shared by the heads of a layer) ---
    omega_init: float = 0.1
    # true: ONE omega vector [align, sep, coh] per layer, shared by all its heads (the "shared vs
    # per-head" ablation); lambdas, delta, kappa and tau_score stay per head either way
    share_omega_across_heads: bool = False

    # --- which biases exist, and when ---
    use_align: bool = True
    use_sep: bool = True
    use_coh: bool = True
    separation_start_step: int = 0  # Separation joins after this many steps (section 12)

    # --- masking and extra biases ---
    causal: bool = True  # every statistic only sees j <= i
    other_bias: str = "none"  # "alibi": add -m_h |i - j| (beta_other, not normalised)

    # --- row normalisation (section 6) ---
    std_form: str = "population"  # "population": 1/n (paper); "sample": 1/(n-1) (seed torch.std)
    eps: float = 1e-6  # in sigma + eps and in vector norms

    # --- auxiliary losses (section 8), weights alpha_1..3 ---
    aux_compactness_weight: float = 0.0  # L_coh
    aux_crowding_weight: float = 0.0  # L_sep
    aux_alignment_weight: float = 0.0  # L_align
    aux_start_step: int = 0  # aux losses join after this many steps

    # --- fast path ---
    chunk_size: int = 128  # query rows per tile in the chunked CPU path
    max_tile_elems: int = 2**20  # cap on b*heads*rows*keys per tile; shrinks the chunk at long n (memory)

    def validate(self, prefix: str, head_dim: int) -> None:
        """Raise ConfigError naming the first inconsistent field (``f"{prefix}.field"``)."""

        def fail(name: str, msg: str) -> None:
            raise ConfigError(f"{prefix}.{name}" if prefix else name, msg)

        bad = non_finite_field(self)
        if bad is not None:
            fail(bad[0], f"must be a finite number (got {bad[1]})")
        for name in ("d_z", "d_a", "k", "chunk_size", "max_tile_elems"):
            if getattr(self, name) < 1:
                fail(name, f"must be >= 1 (got {getattr(self, name)})")
        if self.d_z > head_dim:
            fail("d_z", f"must be <= head dim {head_dim} (got {self.d_z})")
        if self.d_a > head_dim:
            fail("d_a", f"must be <= head dim {head_dim} (got {self.d_a})")
        for name in ("window", "num_global", "separation_start_step", "aux_start_step"):
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0 (got {getattr(self, name)})")
        if self.window > 0 and self.k > self.window:
            fail("k", f"must be <= window (got {self.k} > {self.window})")
        if self.window == 0 and self.num_global > 0:
            fail("num_global", "global tokens only apply to windowed neighbourhoods (window > 0)")
        for name in ("tau_sep", "tau_coh", "eps"):
            if not getattr(self, name) > 0:
                fail(name, f"must be > 0 (got {getattr(self, name)})")
        for name, floor in (("tau_score_init", TAU_SCORE_MIN), ("kappa_init", KAPPA_MIN)):
            if not getattr(self, name) >= floor:  # it would be used at the floor from the first step
                fail(name, f"must be >= {floor:g}, the floor the value is used at (got {getattr(self, name)})")
        for name in (
            "lambda_align", "lambda_sep", "lambda_coh", "alpha_align", "alpha_coh",
            "aux_compactness_weight", "aux_crowding_weight", "aux_alignment_weight",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                fail(name, f"must be >= 0 (got {getattr(self, name)})")
        # each auxiliary loss reads its bias's own quantities (centroids, crowding, headings), which a
        # bias that is off never computes: its weight would be accepted and train nothing
        for weight, bias in (("aux_compactness_weight", "use_coh"), ("aux_crowding_weight", "use_sep"),
                             ("aux_alignment_weight", "use_align")):
            if getattr(self, weight) > 0 and not getattr(self, bias):
                fail(weight, f"must be 0 when {bias} is false (the loss reads that bias's quantities; got "
                             f"{getattr(self, weight)})")
        choices = {
            "kernel_tau_form": KERNEL_TAU_FORMS,
            "std_form": STD_FORMS,
            "other_bias": OTHER_BIASES,
            "gate_placement": GATE_PLACEMENTS,
            "neighbour_source": NEIGHBOUR_SOURCES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                fail(name, f"must be one of {', '.join(allowed)} (got {getattr(self, name)!r})")

    # --- derived quantities used by both implementations ---
    def kernel_denominator(self, tau: float) -> float:
        """Divisor of d_ij^2 in w_ij = exp(-d_ij^2 / .) for the chosen tau form."""
        return tau if self.kernel_tau_form == "tau" else tau * tau

    def separation_active(self, step: int) -> bool:
        """Separation is on after its warm-up (section 12: enable it later than the others)."""
        return self.use_sep and step >= self.separation_start_step

    def aux_active(self, step: int) -> bool:
        """Aux losses are on when a weight is > 0 and the warm-up is over (section 8)."""
        weights = (self.aux_compactness_weight, self.aux_crowding_weight, self.aux_alignment_weight)
        return any(w > 0 for w in weights) and step >= self.aux_start_step
