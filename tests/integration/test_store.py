"""Store layout, cache keys and the one-writer lock."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cache.keys import cache_key
from posttrain.cache.store import Store, StoreLockedError


@pytest.mark.parametrize(
    "a, b, same",
    [
        (
            ("sft", "h1", {"model": "m", "data": "d"}),
            ("sft", "h1", {"data": "d", "model": "m"}),
            True,
        ),  # order-free
        (("sft", "h1", {"model": "m"}), ("sft", "h2", {"model": "m"}), False),  # config changed
        (("sft", "h1", {"model": "m"}), ("sft", "h1", {"model": "m2"}), False),  # upstream output changed
        (("sft", "h1", {"model": "m"}), ("dpo", "h1", {"model": "m"}), False),  # another stage
    ],
)
def test_cache_key_says_what_the_output_depends_on(a, b, same):
    assert (cache_key(*a) == cache_key(*b)) is same


def test_lock_admits_one_run_and_is_released(tmp_path):
    store = Store.at(tmp_path / "store")
    with store.lock():
        code = f"from posttrain.cache.store import Store; Store.at({str(store.root)!r}).lock().__enter__()"
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert other.returncode != 0 and "in use by another posttrain run" in other.stderr
    with store.lock():  # released on exit
        pass


def test_lock_in_the_same_process_is_refused_too(tmp_path):
    store = Store.at(tmp_path)
    with store.lock(), pytest.raises(StoreLockedError, match="pid"), store.lock():
        pass


def test_layout(tmp_path):
    store = Store.at(tmp_path)
    key = "0123456789abcdef01234567"
    assert store.stage_dir("grpo-format", key).name == "grpo-format-0123456789ab"
    assert store.eval_dir("baseline", key).parent.name == "evals"
    assert store.results_dir == tmp_path.resolve() / "results"


def test_clean_interrupted_writes_deletes_partial_outputs_and_restores_a_swapped_out_one(tmp_path):
    store = Store.at(tmp_path)
    stages = tmp_path / "stages"
    (stages / "sft-abc.tmp-1234").mkdir(parents=True)  # killed while training
    (stages / "sft-abc").mkdir()
    (stages / "sft-abc.old-5678").mkdir()  # killed after the swap, before deleting the old one
    (stages / "dpo-def.old-9abc").mkdir()  # killed between the two renames: the only copy
    (stages / "dpo-def.old-9abc" / "stage.json").write_text("{}")
    (tmp_path / "evals" / "baseline-123.tmp-ffff").mkdir(parents=True)
    with store.lock():
        touched = store.clean_interrupted_writes()
    assert len(touched) == 4
    assert sorted(p.name for p in stages.iterdir()) == ["dpo-def", "sft-abc"]
    assert (stages / "dpo-def" / "stage.json").read_text() == "{}"
    assert list((tmp_path / "evals").iterdir()) == []


def test_staging_dir_names_are_the_ones_the_store_cleans(tmp_path):
    from posttrain.core.atomic import STAGING_SUFFIX, staging_dir

    with staging_dir(tmp_path / "stages" / "sft-abc") as tmp:
        (tmp / "model.safetensors").write_text("partial")
        assert tmp.name.startswith("sft-abc" + STAGING_SUFFIX)
    assert (tmp_path / "stages" / "sft-abc" / "model.safetensors").exists()


def _processes_with_prefect_home(home: Path) -> list[str]:
    marker = f"PREFECT_HOME={home}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes():
                found.append(environ.parent.name)
        except OSError:
            continue
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_a_config_error_in_run_kills_the_early_server(smoke_config_path, tmp_path):
    """A config error in `run` is reported as one, and the early Prefect server does not outlive it."""
    smoke = smoke_config_path
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        smoke.read_text().replace("learning_rate: 1.0e-3}", "learning_rate: 1.0e-3, kl_coef: 0.1}")
    )
    store = tmp_path / "store"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME")}
    done = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "run", str(bad), "--set", f"orchestration.store={store}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "unknown SFTConfig option 'kl_coef'" in done.stderr
    assert _processes_with_prefect_home(store / "prefect") == []


def test_a_foreign_folder_is_refused_and_left_untouched(tmp_path):
    from posttrain.cache.store import StoreError

    home = tmp_path / "home"
    (home / "stages" / "thesis.tmp-1").mkdir(parents=True)  # looks like a leftover, is not ours
    (home / "stages" / "draft.old-2").mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(
        StoreError, match=r"is not a posttrain store \(no .posttrain-store marker\) and holds notes.txt"
    ):
        Store.at(home)
    with pytest.raises(StoreError, match="refusing to clean"):
        Store(home.resolve()).clean_interrupted_writes()
    assert sorted(p.name for p in (home / "stages").iterdir()) == ["draft.old-2", "thesis.tmp-1"]
    assert not (home / ".posttrain-store").exists()


def test_new_and_empty_folders_are_marked_and_a_lookalike_is_refused(tmp_path):
    from posttrain.cache.store import MARKER, StoreError

    assert Store.at(tmp_path / "new").is_marked
    (tmp_path / "empty").mkdir()
    assert Store.at(tmp_path / "empty").is_marked
    lookalike = tmp_path / "lookalike"  # only store-like folders, but no marker: not adopted
    for part in ("data", "results"):
        (lookalike / part).mkdir(parents=True)
    (lookalike / "data" / "x.tmp-1").mkdir()
    with pytest.raises(StoreError, match=r"no .posttrain-store marker\) and holds data, results"):
        Store.at(lookalike)
    assert not (lookalike / MARKER).exists() and (lookalike / "data" / "x.tmp-1").is_dir()
    (tmp_path / "linked" / MARKER).parent.mkdir()
    (tmp_path / "linked" / MARKER).symlink_to(tmp_path / "new" / MARKER)  # a marker must be a file
    with pytest.raises(StoreError, match="no .posttrain-store marker"):
        Store.at(tmp_path / "linked")
    assert not Store.at(tmp_path / "dry", create=False).is_marked and not (tmp_path / "dry").exists()


@pytest.mark.parametrize("area", ["stages", "data", "evals", "results", "locks", "prefect", "lock"])
def test_a_store_whose_folder_links_outside_is_refused_and_nothing_outside_is_touched(area, tmp_path):
    from posttrain.cache.store import StoreError

    store = Store.at(tmp_path / "store")
    outside = tmp_path / "outside"
    (outside / "work.tmp-1").mkdir(parents=True)  # would be deleted by tidying through the link
    (outside / "draft.old-2").mkdir()
    (store.root / area).symlink_to(outside)
    with pytest.raises(StoreError, match=f"{area} is a symbolic link"):
        Store.at(store.root)
    with pytest.raises(StoreError, match="symbolic link"), store.lock():
        store.clean_interrupted_writes()
    assert sorted(p.name for p in outside.iterdir()) == ["draft.old-2", "work.tmp-1"]


def test_tidying_skips_links_inside_a_stores_folders(tmp_path):
    store = Store.at(tmp_path / "store")
    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (store.root / "stages").mkdir()
    (store.root / "stages" / "sft-abc.tmp-1").symlink_to(outside)
    (store.root / "stages" / "sft-def.old-2").symlink_to(outside)
    with store.lock():
        assert store.clean_interrupted_writes() == []
    assert (outside / "keep").is_dir()


def test_a_lock_file_planted_as_a_link_is_not_written_through(tmp_path):
    from posttrain.cache.store import StoreError

    store = Store.at(tmp_path / "store")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (store.root / "locks").mkdir()
    (store.root / "locks" / ("a" * 24)).symlink_to(victim)
    with pytest.raises(OSError):
        store.step_lock("a" * 24).acquire()
    store.root.joinpath("lock").symlink_to(victim)
    with pytest.raises(StoreError):
        Store.at(store.root)
    with pytest.raises(StoreError), store.lock():
        pass
    assert victim.read_text() == "precious"


def test_run_takes_the_lock_before_prefects_server_starts(smoke_config_path, tmp_path, capsys):
    """A second run on a locked store stops before booting a server whose home is in that store."""
    from posttrain.cli import main

    smoke = smoke_config_path
    store = Store.at(tmp_path / "store")
    sets = [
        "--set",
        f"orchestration.store={store.root}",
        "--set",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}",
    ]
    with store.lock():
        assert main(["run", str(smoke), *sets]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"orchestration.store: {store.root} is in use by another posttrain run" in err
    )
    assert not (store.root / "prefect").exists() and not (tmp_path / "m.db").exists()
