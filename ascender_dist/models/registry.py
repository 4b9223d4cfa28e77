"""How each layer kind becomes a megatron-core ModuleSpec.

The letters, the architectures and their default patterns are config data
(:mod:`ascender_dist.config.architectures`); what each kind costs in parameters and FLOPs is
:mod:`ascender_dist.models.counting`. A spec builder receives the model's hyperparameters and the
run's seed, never the run config, and imports megatron only when called.
"""

from __future__ import annotations

from ascender_dist.config.schema import ModelConfig


def _gpt_layer(model: ModelConfig, seed: int):
    from ascender_dist.models.specs.norm import local_layer_spec

    return local_layer_spec(model.normalization)


def _ascender_layer(model: ModelConfig, seed: int):
    from ascender_dist.models.specs.ascender import ascender_layer_spec

    return ascender_layer_spec(model.ascender, model.normalization)


def _connection_layer(model: ModelConfig, seed: int):
    from ascender_dist.models.specs.connection import connection_layer_spec

    return connection_layer_spec(model.connection, model.normalization, init_seed=seed)


# one builder per letter of config.architectures.LAYER_KINDS
SPEC_BUILDERS = {"A": _gpt_layer, "S": _ascender_layer, "C": _connection_layer}


def layer_spec(letter: str, model: ModelConfig, seed: int):
    """The megatron ModuleSpec of one layer of kind ``letter``; ``seed`` seeds what a layer
    initialises outside megatron's RNG: the Connection layer's learned weights, drawn unsharded
    so that every TP size starts from the same values (its fixed slots come from
    ``ConnectionHParams.slot_seed``, not from this seed)."""
    return SPEC_BUILDERS[letter](model, seed)
