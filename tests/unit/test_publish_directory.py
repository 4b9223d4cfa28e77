"""publish_directory: the finished directory takes the final name, and that rename reaches stable
storage before the caller writes what points at it (a checkpoint's ``latest``): after a power loss
``latest`` must not name a directory whose rename was lost."""

from __future__ import annotations

from ascender_dist.training import publish


def test_the_rename_is_synced_before_publish_returns(tmp_path, monkeypatch):
    staged, final, aside = tmp_path / "step_2.partial", tmp_path / "step_2", tmp_path / "step_2.replaced"
    staged.mkdir()
    (staged / "COMPLETE").write_text("2\n")
    synced = []
    monkeypatch.setattr(publish, "fsync_dir", lambda d: synced.append((d, (d / "step_2" / "COMPLETE").is_file())))
    assert publish.publish_directory(staged, final, aside) is False
    assert synced == [(tmp_path, True)]  # the parent, once the new name is there
    assert (final / "COMPLETE").read_text() == "2\n" and not staged.exists()
