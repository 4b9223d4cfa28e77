"""Checks run on 2 ranks: tensor-parallel layouts vs TP=1 with the same weights."""

from tests.helpers.multiproc import run_checks
from tests.helpers.parity import tp_parity

DEBUG = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": 32}


def main(args):
    return run_checks({
        "gpt_tp2": lambda: tp_parity({"model": {**DEBUG}}),
        "gpt_swiglu_rmsnorm_gqa_tp2": lambda: tp_parity({"model": {
            **DEBUG, "activation": "swiglu", "normalization": "RMSNorm", "num_query_groups": 2,
            "add_bias_linear": False}}),
        "gpt_learned_pos_untied_tp2": lambda: tp_parity({"model": {
            **DEBUG, "position_embedding_type": "learned_absolute", "untie_embeddings_and_output_weights": True}}),
    })
