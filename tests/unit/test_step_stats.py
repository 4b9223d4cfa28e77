"""Layer statistics over all forwards of one step (every micro-batch), not the last one only."""

import pytest
import torch

from ascender_dist.models.specs.step_stats import accumulate_stats


def test_mean_over_forwards_and_max_for_max_statistics():
    forwards = [{"steps_mean": torch.tensor(v), "steps_max": torch.tensor(2 * v),
                 "mass_moved_all": torch.tensor([v, -v])} for v in (1.0, 4.0, 7.0)]
    stats = {}
    for count, new in enumerate(forwards):
        stats = accumulate_stats(stats, new, count)
    assert stats["steps_mean"].item() == pytest.approx(4.0)
    assert stats["steps_max"].item() == 14.0
    assert torch.allclose(stats["mass_moved_all"], torch.tensor([4.0, -4.0]))
    assert forwards[0]["steps_mean"].item() == 1.0  # the first forward's tensors are not written into


def test_switching_collection_on_starts_a_new_step():
    from ascender_dist.training.layer_stats import set_collect_stats

    layer = torch.nn.Linear(1, 1)
    layer.collect_stats, layer.last_stats, layer.stats_forwards = False, {"steps_max": torch.tensor(3.0)}, 4
    set_collect_stats(layer, True)
    assert (layer.collect_stats, layer.last_stats, layer.stats_forwards) == (True, {}, 0)


def test_a_0d_statistic_of_a_per_head_layer_is_logged_for_the_layer_only():
    """An aux loss is one value over the rank's heads: logged as the layer's, not as a head's."""
    from ascender_dist.training.layer_stats import gather_layer_stats

    layer = torch.nn.Linear(1, 1)
    layer.collect_stats, layer.stats_per_head, layer.layer_number, layer.stats_prefix = True, True, 3, "ascender"
    layer.last_stats = {"aux_total": torch.tensor(0.25), "eta_mean": torch.tensor([0.5, 1.5])}
    assert gather_layer_stats(layer) == {"ascender/aux_total/layer03": 0.25, "ascender/eta_mean/layer03": 1.0,
                                         "ascender/eta_mean/layer03/head00": 0.5,
                                         "ascender/eta_mean/layer03/head01": 1.5}
