"""Checks run on 2 ranks: tensor-parallel layouts vs TP=1 with the same weights."""

from tests.helpers.multiproc import run_checks
from tests.helpers.parity import tp_parity

ASC = {"d_z": 8, "d_a": 8, "k": 4, "window": 16, "num_global": 2, "chunk_size": 16, "omega_init": 0.5}
DEBUG = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": 32}


def main(args):
    return run_checks({
        "gpt_tp2": lambda: tp_parity({"model": {**DEBUG}}),
        "gpt_swiglu_rmsnorm_gqa_tp2": lambda: tp_parity({"model": {
            **DEBUG, "activation": "swiglu", "normalization": "RMSNorm", "num_query_groups": 2,
            "add_bias_linear": False}}),
        "gpt_learned_pos_untied_tp2": lambda: tp_parity({"model": {
            **DEBUG, "position_embedding_type": "learned_absolute", "untie_embeddings_and_output_weights": True}}),
        "ascender_tp2": lambda: tp_parity({"model": {**DEBUG, "architecture": "ascender", "ascender": ASC}}),
        "ascender_gqa_swiglu_tp2": lambda: tp_parity({"model": {
            **DEBUG, "architecture": "ascender", "ascender": {**ASC, "other_bias": "alibi"},
            "num_query_groups": 2, "activation": "swiglu"}}),
    })
