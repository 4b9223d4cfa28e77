"""The console warnings every entry point silences: only those no user can act on."""

import warnings

from ascender_dist.logs import quiet_library_warnings


def _shown(message: str, category=UserWarning) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_library_warnings()
        warnings.warn(message, category)
    return bool(caught)


def test_library_warnings_no_user_can_act_on_are_silenced():
    # torch's, each time DeepSpeed's ZeRO gathers partitions (every rank of every run printed it)
    assert not _shown("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single` instead.", FutureWarning)
    assert not _shown("Apex is not installed. Falling back to Torch Norm")


def test_other_warnings_still_show():
    assert _shown("`torch.distributed.all_gather_into_tensor` is deprecated.", UserWarning)  # another category
    assert _shown("some other deprecation", FutureWarning)
