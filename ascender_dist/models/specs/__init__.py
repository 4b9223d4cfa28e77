"""megatron-core wiring of each layer kind: ``norm`` (megatron's local GPT layer with a TP-safe
norm, kind ``A``), ``ascender`` (kind ``S``), ``connection`` (kind ``C``), and ``block`` (one
spec per layer from ``model.layer_pattern``). :mod:`ascender_dist.models.registry` maps the letters
to these builders."""
