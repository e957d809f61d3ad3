"""Checkpoint trust and crash safety, on the checkpoint functions directly (no Trainer).

* crashes (real ``os._exit`` of a rank, or an exception) at each phase of a 2-rank save over an
  existing checkpoint leave the old or the new checkpoint, complete;
* corrupt files (missing, truncated, bit-flipped, from another checkpoint, unlisted, a broken
  manifest) raise ``PipelineConfigError`` naming the checkpoint, the file and the problem;
* crafted pickles in ``.metadata``, ``meta.pt``, an RNG file or a DCP entry raise a clear error
  and run nothing; ``weights_only=False`` / ``--unsafe-load`` opens only what it says.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_mmpp import ModulePlacement as P
from lightning_mmpp.state import checkpoint as ckpt
from lightning_mmpp.model import checkpoint_files as files
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.state.export import main as export_main
from lightning_mmpp.core.placement import PipelineLayout
from tests.dist import run_distributed

TOPOLOGY = {"enc": ["llm"], "llm": []}
LAYOUT_2 = {"enc": P(), "llm": P()}  # rank 0: enc, rank 1: llm
LAYOUT_1 = {"enc": P(rank_offset=0), "llm": P(rank_offset=0)}  # colocated on one rank
CPU = torch.device("cpu")


class Tiny(nn.Module):
    """``enc`` and ``llm`` layers; a rank keeps only the modules it holds (as partitioning does)."""

    def __init__(self, keep: tuple[str, ...] = ("enc", "llm")) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 4))
        self.llm = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
        for name in ("enc", "llm"):
            if name not in keep:
                setattr(self, name, nn.Sequential())


def _state(layout: PipelineLayout, rank: int, version: int) -> tuple[Tiny, torch.optim.Optimizer, dict]:
    """This rank's part of the model with every weight equal to ``version``, an Adam that has
    stepped, and the Lightning checkpoint dict for it."""
    model = Tiny(tuple(m for m in layout.modules if layout.slot(rank, m) is not None))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(version))
    checkpoint = {
        "state_dict": ckpt.model_state_dict(model),
        "optimizer_states": [ckpt.optimizer_state_by_name(model, opt)],
        "global_step": version,
        "epoch": 0,
    }
    return model, opt, checkpoint


def _save(layout: PipelineLayout, rank: int, version: int, path: Path) -> None:
    model, _, checkpoint = _state(layout, rank, version)
    ckpt.save_checkpoint(checkpoint, path, model=model, layout=layout, rank=rank, device=CPU)


def _version(path: Path) -> int:
    """The version a complete checkpoint holds (verified read of every weight and meta.pt)."""
    weights = ckpt.read_checkpoint_tensors(path)
    assert set(weights) == {"enc.0.weight", "enc.0.bias", "llm.0.weight", "llm.0.bias", "llm.1.weight", "llm.1.bias"}
    values = {float(v.unique().item()) for v in weights.values()}
    meta = torch.load(path / "meta.pt", weights_only=True)
    assert values == {float(meta["global_step"])}, (values, meta["global_step"])
    return int(meta["global_step"])


# --- crashes during a save -----------------------------------------------------------------------


def _die(*_args, **_kwargs):
    os._exit(17)


def _crashing_save(rank: int, world: int, path: str, phase: str) -> None:
    layout = PipelineLayout(LAYOUT_2, TOPOLOGY)
    final = Path(path)
    _save(layout, rank, 1, final)  # the previous checkpoint (also clears an earlier launch's leftovers)
    if phase == "rank 1 after its data files" and rank == 1:
        ckpt._records_of_rank = _die
    elif phase == "before meta.pt" and rank == 0:
        ckpt._write_meta = _die
    elif phase == "before the manifest" and rank == 0:
        ckpt._write_manifest = _die
    elif phase == "before the rename" and rank == 0:
        ckpt._publish = _die
    elif phase == "between the fallback renames" and rank == 0:
        move_aside = files._move_aside
        files._exchange = lambda a, b: False

        def aside_then_die(final):
            move_aside(final)
            _die()

        files._move_aside = aside_then_die
    elif phase == "after the exchange" and rank == 0:
        files.remove_directory = _die
    _save(layout, rank, 2, final)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.distributed
def test_a_crash_at_any_phase_of_a_save_leaves_the_old_or_the_new_checkpoint(tmp_path):
    final = tmp_path / "last.ckpt"
    expected = {
        "rank 1 after its data files": 1,
        "before meta.pt": 1,
        "before the manifest": 1,
        "before the rename": 1,
        "after the exchange": 2,
    }
    for phase, version in expected.items():
        with pytest.raises(AssertionError, match="exited with code 17|exited \\(code 17\\)"):
            run_distributed(_crashing_save, 2, str(final), phase, timeout=60)
        assert _version(final) == version, phase
        visible = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
        assert visible == ["last.ckpt"], (phase, visible)

    # the fallback for file systems without an atomic exchange: between its two renames the
    # name is free and the previous checkpoint waits, complete, under a hidden name
    with pytest.raises(AssertionError, match="exited with code 17|exited \\(code 17\\)"):
        run_distributed(_crashing_save, 2, str(final), "between the fallback renames", timeout=60)
    assert not final.exists()
    aside = files.interrupted_replacement(final)
    assert aside is not None and _version(aside) == 1
    with pytest.raises(FileNotFoundError, match=f"previous checkpoint complete at {str(aside)!r}: rename"):
        ckpt.read_checkpoint_tensors(final)
    os.rename(aside, final)
    assert _version(final) == 1


def _failing_saves(rank: int, world: int, path: str) -> dict:
    layout = PipelineLayout(LAYOUT_2, TOPOLOGY)
    final = Path(path)
    _save(layout, rank, 1, final)
    out: dict = {}

    def disk_full(*_args):
        raise OSError(28, "No space left on device")

    if rank == 0:
        ckpt._write_manifest = disk_full
    try:
        _save(layout, rank, 2, final)
    except OSError as exc:
        out["error"] = (type(exc).__name__, str(exc))
    ckpt._write_manifest = _write_manifest
    # rank 1 fails while writing its own files: every rank raises its error
    if rank == 1:
        ckpt._rng_state = disk_full
    try:
        _save(layout, rank, 2, final)
    except OSError as exc:
        out["error of rank 1"] = (type(exc).__name__, str(exc))
    ckpt._rng_state = _rng_state
    # a successful save through the fallback path (no atomic exchange available)
    files._exchange = lambda a, b: False
    _save(layout, rank, 3, final)
    files._exchange = _exchange
    out["hidden"] = sorted(p.name for p in final.parent.iterdir() if p.name.startswith("."))
    return out


_write_manifest = ckpt._write_manifest
_rng_state = ckpt._rng_state
_exchange = files._exchange


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.distributed
def test_a_failing_save_raises_on_every_rank_and_keeps_the_old_checkpoint(tmp_path):
    final = tmp_path / "ckpt"
    results = run_distributed(_failing_saves, 2, str(final), timeout=60)
    assert results[0]["error"] == results[1]["error"]
    assert results[0]["error"][0] == "OSError" and "No space left on device" in results[0]["error"][1]
    assert results[0]["error of rank 1"] == results[1]["error of rank 1"]
    assert "No space left on device" in results[0]["error of rank 1"][1]
    assert _version(final) == 3
    assert results[0]["hidden"] == []  # no staging or replaced directories left behind


# --- corrupt files -------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> Path:
    layout = PipelineLayout(LAYOUT_1, TOPOLOGY)
    _save(layout, 0, 5, tmp_path / "a.ckpt")
    _save(layout, 0, 6, tmp_path / "b.ckpt")
    return tmp_path / "a.ckpt"


def _data_file(path: Path) -> str:
    (name,) = [p.name for p in path.iterdir() if p.name.endswith(".distcp")]
    return name


def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_corrupt_files_are_named(saved):
    where = f"checkpoint {str(saved)!r}: file "
    assert _version(saved) == 5
    data = _data_file(saved)
    pristine = saved.parent / "pristine"
    shutil.copytree(saved, pristine)

    def restore():
        shutil.rmtree(saved)
        shutil.copytree(pristine, saved)

    def truncate():
        with open(saved / data, "r+b") as f:
            f.truncate(100)

    def foreign():
        other = saved.parent / "b.ckpt" / data
        assert other.stat().st_size == (saved / data).stat().st_size
        shutil.copy(other, saved / data)

    for corrupt, problem in (
        (truncate, "is truncated: 100 bytes on disk"),  # an interrupted copy: no longer a bare EOFError
        (lambda: (saved / data).unlink(), f"is missing ({str(saved / data)!r})"),
        (lambda: _flip_bit(saved / data, (saved / data).stat().st_size // 2), "is corrupt: its CRC32 is"),
        (foreign, "or the file comes from another checkpoint"),  # same name and size, other bytes
    ):
        restore()
        corrupt()
        with pytest.raises(PipelineConfigError) as info:
            ckpt.read_checkpoint_tensors(saved)
        message = str(info.value)
        assert message.startswith(f"{where}{data!r} (it holds 'model/enc.0.bias' and 5 more entries) "), message
        assert problem in message, message
        with pytest.raises(PipelineConfigError, match="is (truncated|missing|corrupt)"):  # export reads the same way
            ckpt.export_checkpoint(saved, saved.parent / "out.ckpt")

    # meta.pt and the index are verified before they are parsed
    for name in ("meta.pt", ".metadata"):
        restore()
        _flip_bit(saved / name, 40)
        with pytest.raises(PipelineConfigError, match=f"{where}{name!r} is corrupt"):
            ckpt.export_checkpoint(saved, saved.parent / "out.ckpt")
    restore()
    _flip_bit(saved / "meta.pt", 40)
    assert set(ckpt.read_checkpoint_tensors(saved, ["llm.1.bias"])) == {"llm.1.bias"}  # reads no meta.pt

    # the manifest itself: missing, broken, or not listing a file that is read
    restore()
    (saved / "manifest.json").write_text("{not json")
    with pytest.raises(PipelineConfigError, match="manifest.json is corrupt"):
        ckpt.read_checkpoint_tensors(saved)
    (saved / "manifest.json").unlink()
    with pytest.raises(PipelineConfigError, match="has no manifest.json: it is not a complete checkpoint"):
        ckpt.read_checkpoint_tensors(saved)
    restore()
    manifest = json.loads((saved / "manifest.json").read_text())
    del manifest["files"][data]
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PipelineConfigError, match=f"{where}{data!r} .*is not listed in its manifest.json"):
        ckpt.read_checkpoint_tensors(saved)

    # an unknown name
    restore()
    with pytest.raises(PipelineConfigError, match="has no entry 'model/nope'"):
        ckpt.read_checkpoint_tensors(saved, ["nope"])
    assert set(ckpt.read_checkpoint_tensors(saved, ["llm.1.bias"])) == {"llm.1.bias"}


# --- crafted pickles -----------------------------------------------------------------------------


class _CreatesFile:
    """Unpickling this creates ``marker`` (if the unpickler lets it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


class _RunsShell:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _reseal(path: Path) -> None:
    """Rewrite the manifest for the files as they are now (what an attacker would do)."""
    records = {
        name: files.file_record(path / name)
        for name in json.loads((path / "manifest.json").read_text())["files"]
    }
    files.write_manifest(path, records, ckpt.FORMAT_VERSION)


def test_crafted_pickles_run_nothing(saved, tmp_path):
    marker = tmp_path / "executed"
    layout = PipelineLayout(LAYOUT_1, TOPOLOGY)
    pristine = tmp_path / "pristine"
    shutil.copytree(saved, pristine)

    def load_for_fit(weights_only=None):
        model, opt, _ = _state(layout, 0, 0)
        return ckpt.load_checkpoint(
            saved, model=model, optimizers=[opt], layout=layout, rank=0, device=CPU, fitting=True,
            weights_only=weights_only,
        )

    # sanity: the pristine checkpoint resumes (weights, Adam state by name, RNG)
    loaded = load_for_fit()
    assert float(loaded["state_dict"]["llm.1.bias"][0]) == 5.0
    assert set(loaded["optimizer_states"][0]["state"]["enc.0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}

    for name, payload, needle in (
        (".metadata", _RunsShell(marker), "its index '.metadata' cannot be read safely (UnpicklingError: posix.system"),
        (".metadata", _CreatesFile(marker), "is not part of a checkpoint index"),
        ("meta.pt", _CreatesFile(marker), "'meta.pt' (Lightning's state) holds objects other than tensors"),
        ("rng_rank0.pt", _RunsShell(marker), "'rng_rank0.pt' (RNG states) holds objects other than tensors"),
    ):
        shutil.rmtree(saved)
        shutil.copytree(pristine, saved)
        with open(saved / name, "wb") as f:
            if name == ".metadata":
                pickle.dump(payload, f)
            else:
                torch.save(payload, f)
        _reseal(saved)
        with pytest.raises(PipelineConfigError) as info:
            load_for_fit()
        message = str(info.value)
        assert message.startswith(f"checkpoint {str(saved)!r}: ") and needle in message, message
        assert "othing from it was executed" in message, message
        assert not marker.exists(), f"unpickling {name} ran code"
        if name != "meta.pt":
            # the opt-in opens meta.pt and DCP entries only: the index and the RNG files stay safe
            with pytest.raises(PipelineConfigError, match="othing from it was executed"):
                load_for_fit(weights_only=False)
            assert not marker.exists(), f"unpickling {name} ran code"
        if name != "rng_rank0.pt":  # export reads no RNG file
            assert export_main([str(saved), str(tmp_path / "out.ckpt")]) == 1
            assert not marker.exists(), f"unpickling {name} ran code"


def test_a_crafted_dcp_entry_runs_nothing(tmp_path):
    marker = tmp_path / "executed"
    path = tmp_path / "evil.ckpt"
    layout = PipelineLayout(LAYOUT_1, TOPOLOGY)
    model, _, checkpoint = _state(layout, 0, 1)
    checkpoint["state_dict"]["enc._extra_state"] = _RunsShell(marker)  # a non-tensor entry: pickled by DCP
    ckpt.save_checkpoint(checkpoint, path, model=model, layout=layout, rank=0, device=CPU)
    assert not marker.exists()
    with pytest.raises(PipelineConfigError, match="a non-tensor entry of the DCP data holds objects other than"):
        ckpt.read_checkpoint_tensors(path)
    assert not marker.exists()
    with pytest.raises(PipelineConfigError, match="Nothing from it was executed"):
        ckpt.export_checkpoint(path, tmp_path / "out.ckpt")
    assert not marker.exists()


def test_unsafe_load_opens_trusted_objects(tmp_path, capsys):
    """A checkpoint whose hooks stored other objects: refused by default, exported with the opt-in."""
    path = tmp_path / "hooks.ckpt"
    layout = PipelineLayout(LAYOUT_1, TOPOLOGY)
    model, _, checkpoint = _state(layout, 0, 1)
    checkpoint["user_ratio"] = Fraction(1, 3)  # what an on_save_checkpoint hook might add
    ckpt.save_checkpoint(checkpoint, path, model=model, layout=layout, rank=0, device=CPU)
    out = tmp_path / "model.ckpt"
    assert export_main([str(path), str(out)]) == 1
    assert "--unsafe-load" in capsys.readouterr().err
    assert export_main([str(path), str(out), "--unsafe-load"]) == 0
    exported = torch.load(out, weights_only=False)
    assert exported["user_ratio"] == Fraction(1, 3)
    assert torch.equal(exported["state_dict"]["llm.1.bias"], torch.ones(3))

    # resuming: Trainer.fit(..., weights_only=False) reaches load_checkpoint the same way
    def load(**kwargs):
        return ckpt.load_checkpoint(path, model=model, optimizers=[], layout=layout, rank=0, device=CPU,
                                    fitting=False, **kwargs)

    with pytest.raises(PipelineConfigError, match="'meta.pt' .* weights_only=False"):
        load()
    assert load(weights_only=False)["user_ratio"] == Fraction(1, 3)


def test_unsafe_load_help_says_what_it_allows(capsys):
    with pytest.raises(SystemExit):
        export_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "meta.pt" in text and "weights_only=False" in text and "run arbitrary code" in text
    assert "index (.metadata) and RNG files are always read with the safe loader" in text


def test_metadata_unpickler_allows_only_the_index_classes(tmp_path):
    buffer = io.BytesIO()
    pickle.dump({"a": torch.Size([2, 3]), "d": torch.bfloat16}, buffer)
    (tmp_path / ".metadata").write_bytes(buffer.getvalue())
    with pytest.raises(PipelineConfigError, match="holds a dict, not a torch.distributed.checkpoint Metadata"):
        files.read_dcp_metadata(tmp_path)
    pickle.dump(Fraction(1, 2), open(tmp_path / ".metadata", "wb"))
    with pytest.raises(PipelineConfigError, match="fractions.Fraction is not part of a checkpoint index"):
        files.read_dcp_metadata(tmp_path)


def test_metadata_unpickler_resolves_no_torch_function(tmp_path):
    """Of ``torch.<name>`` only dtypes and layouts resolve: a crafted index cannot reach torch.save,
    torch.load, torch.ops and the like."""
    marker = tmp_path / "written"
    calls_torch_save = b"ctorch\nsave\n(S'x'\nS'" + str(marker).encode() + b"'\ntR."  # torch.save("x", marker)
    for name, crafted in (("save", calls_torch_save), ("load", b"ctorch\nload\n."), ("ops", b"ctorch\nops\n.")):
        (tmp_path / ".metadata").write_bytes(crafted)
        with pytest.raises(PipelineConfigError, match=f"torch.{name} is not part of a checkpoint index"):
            files.read_dcp_metadata(tmp_path)
        assert not marker.exists(), f"unpickling torch.{name} ran code"
    # what the index does hold still resolves: a dtype and a layout inside a dict (not a Metadata)
    (tmp_path / ".metadata").write_bytes(b"(dp0\nS'd'\nctorch\nbfloat16\nsS'l'\nctorch\nstrided\ns.")
    with pytest.raises(PipelineConfigError, match="holds a dict, not a torch.distributed.checkpoint Metadata"):
        files.read_dcp_metadata(tmp_path)


# --- optimizer state by name ---------------------------------------------------------------------


def test_saving_before_the_first_step_leaves_the_optimizer_alone():
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = ckpt.optimizer_state_by_name(model, opt)
    assert state["state"] == {} and not opt.state  # torch's helper would have run a zero step
    assert state["param_groups"][0]["params"] == [n for n, _ in model.named_parameters()]


def test_export_indexes_optimizer_state_in_model_order(tmp_path):
    """Each group's parameters are exported in the model's order; a different order is flagged."""
    layout = PipelineLayout(LAYOUT_1, TOPOLOGY)
    for reverse in (False, True):
        model = Tiny()
        params = list(model.parameters())
        opt = torch.optim.SGD(params[::-1] if reverse else params, lr=0.1, momentum=0.9)
        for i, p in enumerate(model.parameters()):
            p.grad = torch.full_like(p, float(i))
        opt.step()
        checkpoint = {"state_dict": ckpt.model_state_dict(model), "optimizer_states": [
            ckpt.optimizer_state_by_name(model, opt)], "global_step": 1}
        path = tmp_path / f"reverse={reverse}"
        ckpt.save_checkpoint(checkpoint, path, model=model, layout=layout, rank=0, device=CPU)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt.export_checkpoint(path, tmp_path / "out.ckpt")
        flagged = [w for w in caught if "in another order than the model's" in str(w.message)]
        assert len(flagged) == int(reverse)
        exported = torch.load(tmp_path / "out.ckpt", weights_only=True)["optimizer_states"][0]
        assert exported["param_groups"][0]["params"] == list(range(len(params)))
        for i, p in enumerate(model.parameters()):  # index i holds the i-th parameter's momentum
            torch.testing.assert_close(exported["state"][i]["momentum_buffer"], torch.full_like(p, float(i)))


def test_reading_a_foreign_dcp_directory(tmp_path):
    """A DCP directory not written by this package (no manifest): refused unless verify=False."""
    import torch.distributed.checkpoint as dcp

    state = {"layer.weight": torch.arange(6.0).reshape(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "foreign")), no_dist=True)
    with pytest.raises(PipelineConfigError, match="has no manifest.json"):
        ckpt.read_checkpoint_tensors(tmp_path / "foreign", prefix="")
    read = ckpt.read_checkpoint_tensors(tmp_path / "foreign", prefix="", verify=False)
    assert torch.equal(read["layer.weight"], state["layer.weight"])


# --- DTensor (FSDP2-sharded) state goes through the same functions ------------------------------


def _dtensor_round_trips(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layout = PipelineLayout({"enc": P(dp=2, rank_offset=0), "llm": P(dp=2, rank_offset=0)}, TOPOLOGY)
    mesh = init_device_mesh("cpu", (2,))

    def build(seed: int, shard: bool) -> tuple[Tiny, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = Tiny()
        if shard:
            for layer in [*model.enc, *model.llm]:
                fully_shard(layer, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    def full(value):
        return value.full_tensor() if hasattr(value, "full_tensor") else value

    def state(model, opt) -> dict:
        return {
            "model": {k: full(v).clone() for k, v in ckpt.model_state_dict(model).items()},
            "exp_avg": {
                k: full(s["exp_avg"]).clone() for k, s in ckpt.optimizer_state_by_name(model, opt)["state"].items()
            },
        }

    out = {}
    for label, shard_saved in (("sharded -> sharded", True), ("unsharded -> sharded", False)):
        model, opt = build(0, shard_saved)
        model.llm(model.enc(torch.ones(2, 4))).sum().backward()
        opt.step()
        path = Path(root) / label.replace(" ", "")
        checkpoint = {"state_dict": ckpt.model_state_dict(model), "optimizer_states": [
            ckpt.optimizer_state_by_name(model, opt)], "global_step": 1}
        out[f"{label} types"] = sorted({type(v).__name__ for v in checkpoint["state_dict"].values()})
        ckpt.save_checkpoint(checkpoint, path, model=model, layout=layout, rank=rank, device=CPU)
        saved = state(model, opt)
        model2, opt2 = build(1, True)
        loaded = ckpt.load_checkpoint(path, model=model2, optimizers=[opt2], layout=layout, rank=rank, device=CPU,
                                      fitting=True)
        ckpt.load_model_state(model2, loaded["state_dict"])
        ckpt.load_optimizer_states(model2, [opt2], loaded["optimizer_states"], CPU)
        out[label] = (saved, state(model2, opt2), str(path))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.distributed
def test_dtensor_state_saves_and_resumes_across_sharding(tmp_path):
    results = run_distributed(_dtensor_round_trips, 2, str(tmp_path), timeout=90)
    assert results[0]["sharded -> sharded types"] == ["DTensor"]
    assert results[0]["unsharded -> sharded types"] == ["Tensor"]
    for label in ("sharded -> sharded", "unsharded -> sharded"):
        saved, restored, path = results[0][label]
        for part in ("model", "exp_avg"):
            assert saved[part].keys() == restored[part].keys()
            for name in saved[part]:
                assert torch.equal(saved[part][name], restored[part][name]), (label, part, name)
        on_disk = ckpt.read_checkpoint_tensors(path)  # one process reads the full tensors
        for name, value in saved["model"].items():
            assert torch.equal(on_disk[name], value), (label, name)


def test_remote_urls_are_refused_and_file_urls_are_local(saved):
    with pytest.raises(PipelineConfigError, match="remote URLs are not supported"):
        ckpt.read_checkpoint_tensors("s3://bucket/ckpt")
    assert set(ckpt.read_checkpoint_tensors(f"file://{saved}", ["enc.0.bias"])) == {"enc.0.bias"}


# --- the user's view: a run killed while ModelCheckpoint rewrites last.ckpt ----------------------


def _killed_while_rewriting_last(rank: int, world: int, root: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.test_checkpoint import LAYOUT_B, _loader, _model, _trainer

    write_meta = ckpt._write_meta

    def killed_at_step_2(meta, staging):
        if meta["global_step"] == 2:
            _die()  # after every rank's data files, before meta.pt: issue 16's data loss
        write_meta(meta, staging)

    if rank == 0:
        ckpt._write_meta = killed_at_step_2
    last = ModelCheckpoint(dirpath=root, save_top_k=0, save_last=True, every_n_train_steps=1)
    _trainer(LAYOUT_B, 1, [last]).fit(_model(), _loader())


def _resume_last(rank: int, world: int, root: str) -> dict:
    import lightning as L

    from tests.test_checkpoint import LAYOUT_B, _loader, _model, _trainer

    class Start(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.step = trainer.global_step
            self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    start = Start()
    _trainer(LAYOUT_B, 1, [start]).fit(_model(), _loader(), ckpt_path=str(Path(root) / "last.ckpt"))
    return {"step": start.step, "params": start.params}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_run_killed_while_rewriting_last_ckpt_resumes_from_it(tmp_path):
    with pytest.raises(AssertionError, match="exited with code 17|exited \\(code 17\\)"):
        run_distributed(_killed_while_rewriting_last, 2, str(tmp_path), timeout=90, init_pg=False)
    last = tmp_path / "last.ckpt"
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 1  # the previous last.ckpt, intact
    stored = ckpt.read_checkpoint_tensors(last)
    results = run_distributed(_resume_last, 2, str(tmp_path), timeout=90, init_pg=False)
    assert all(r["step"] == 1 for r in results)
    restored = {n: v for r in results for n, v in r["params"].items()}
    assert restored.keys() == stored.keys() - {n for n in stored if not n.endswith(("weight", "bias"))}
    for name, value in restored.items():
        assert torch.equal(value, stored[name]), name


def test_pretrained_weights_from_a_crafted_checkpoint_run_nothing(saved, tmp_path):
    """``pretrained=`` reads DCP directories (ours included) through the same safe reader."""
    from lightning_mmpp.model.pretrained import open_source

    source = open_source("llm", saved)
    dest = {"1.bias": torch.empty(3)}
    source.read(dest)
    assert torch.equal(dest["1.bias"], torch.full((3,), 5.0))
    marker = tmp_path / "executed"
    pickle.dump(_RunsShell(marker), open(saved / ".metadata", "wb"))
    with pytest.raises(PipelineConfigError, match="cannot be read safely"):
        open_source("llm", saved)
    assert not marker.exists()
