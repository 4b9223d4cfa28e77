"""Hugging Face ``trust_remote_code`` model of ascender-dist decoders (gpt, ascender, connection, mixed).

``ascender-dist export-hf`` copies ``configuration_ascender_dist.py``, ``modeling_ascender_dist.py``
and ``tokenization_ascender_dist.py`` from here into the export directory, together with vendored
copies of the pure-torch ASCender / Connection math (see :mod:`ascender_dist.hf.vendor`), so the
directory loads with ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` on a
machine that has torch, transformers and sentencepiece but not ascender-dist.

Inside this package the same classes import the math from ``ascender_dist.models`` directly
(``ascender_dist_kernels.py``); :func:`register_auto_classes` makes ``AutoConfig`` /
``AutoModelForCausalLM`` know the model type without remote code.
"""

REMOTE_CODE_FILES = ("configuration_ascender_dist.py", "modeling_ascender_dist.py", "tokenization_ascender_dist.py")


def register_auto_classes() -> None:
    """Register ``ascender_dist`` with transformers' Auto classes (in-process use, no remote code)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ascender_dist.hf.configuration_ascender_dist import AscenderDistConfig
    from ascender_dist.hf.modeling_ascender_dist import AscenderDistForCausalLM

    try:
        AutoConfig.register("ascender_dist", AscenderDistConfig)
        AutoModelForCausalLM.register(AscenderDistConfig, AscenderDistForCausalLM)
    except ValueError:  # already registered
        pass
