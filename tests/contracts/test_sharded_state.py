"""Reading a state folder (contracts/sharded_state.py) trusts nothing in it: its files come
from ranks that run user code, and the portal reads them to build a download."""

import dataclasses
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from contracts import sharded_state


def _folder(tmp_path: Path, state: dict) -> tuple[Path, list[str]]:
    folder = tmp_path / "step-8.pt.dcp"
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder, sorted(p.name for p in folder.iterdir())


def _rewrite(folder: Path, change) -> None:  # type: ignore[no-untyped-def]
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_folder_reads_back_into_whole_tensors(tmp_path: Path) -> None:
    saved = {"state.0.exp_avg": torch.arange(6.0).view(2, 3)}
    folder, files = _folder(tmp_path, saved)
    template = {"state.0.exp_avg": torch.zeros(2, 3)}
    sharded_state.load_into(template, folder, files)
    assert torch.equal(template["state.0.exp_avg"], saved["state.0.exp_avg"])


def test_metadata_naming_a_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder, files = _folder(tmp_path, {"state.0.exp_avg": torch.ones(3)})

    def escape(metadata) -> None:  # type: ignore[no-untyped-def]
        for key, info in metadata.storage_data.items():
            metadata.storage_data[key] = dataclasses.replace(info, relative_path="../../secret")

    _rewrite(folder, escape)
    with pytest.raises(ValueError, match="names file '../../secret'"):
        sharded_state.read_metadata(folder, files)


@pytest.mark.parametrize(
    ("claim", "said"),
    [
        ([1 << 20, 1 << 10], "claims 4294967308 bytes; its files hold"),  # huge, from little
        ([-5, 3], "has a chunk outside its shape"),  # a negative size, to lower the sum
    ],
)
def test_metadata_claiming_more_than_its_files_hold_is_refused(
    claim: list[int], said: str, tmp_path: Path
) -> None:
    folder, files = _folder(tmp_path, {"state.0.exp_avg": torch.ones(3)})

    def inflate(metadata) -> None:  # type: ignore[no-untyped-def]
        item = metadata.state_dict_metadata["state.0.exp_avg"]
        chunk = dataclasses.replace(item.chunks[0], offsets=torch.Size([0, 0]))
        metadata.state_dict_metadata["state.1.exp_avg"] = dataclasses.replace(
            item,
            size=torch.Size(claim),
            chunks=[dataclasses.replace(chunk, sizes=torch.Size(claim))],
        )

    _rewrite(folder, inflate)
    with pytest.raises(ValueError, match=said):
        sharded_state.read_metadata(folder, files)


def test_metadata_holding_anything_but_tensors_is_refused(tmp_path: Path) -> None:
    folder, files = _folder(tmp_path, {"state.0.exp_avg": torch.ones(3), "note": "hello"})
    with pytest.raises(pickle.UnpicklingError, match="may not name .*BytesStorageMetadata"):
        sharded_state.read_metadata(folder, files)


def test_a_groups_folder_names_its_group() -> None:
    assert sharded_state.group_of_folder(sharded_state.folder_of("step-8.pt", 12)) == 12
    assert sharded_state.group_of_folder(sharded_state.folder_of("epoch-1.pt")) is None
    assert sharded_state.group_of_folder("g3.dcp") is None  # no checkpoint name before it


def test_part_names_are_a_state_folder_and_dcps_files_only() -> None:
    assert sharded_state.check_part("step-8.pt.dcp/__12_0.distcp") == (
        "step-8.pt.dcp",
        "__12_0.distcp",
    )
    for bad in ["step-8.pt.dcp/../x", "../step-8.pt.dcp/.metadata", "step-8.pt/.metadata", "x"]:
        with pytest.raises(ValueError, match="no part of a state folder"):
            sharded_state.check_part(bad)


def _sliced_checkpoint(
    tmp_path: Path, params: torch.Tensor, cut: int, momentum: torch.Tensor | None = None
) -> dict:
    """A checkpoint dict of a Linear(2, 3) + bias whose 9 parameter elements ``params`` (and
    outer ``momentum``) two owners wrote, slices ``[0, cut)`` and ``[cut, 9)``, beside its
    file in ``tmp_path``."""
    slices = []
    for shard, (a, b) in enumerate(((0, cut), (cut, 9))):
        folder = tmp_path / sharded_state.slice_folder("step-8.pt", shard)
        tensors = {"params": params[a:b].clone()}
        if momentum is not None:
            tensors["momentum"] = momentum[a:b].clone()
        dcp.save(tensors, checkpoint_id=folder, no_dist=True)
        files = sorted(p.name for p in folder.iterdir())
        slices.append({"folder": folder.name, "files": files})
    model = torch.nn.Linear(2, 3)
    names = {"weight": 0, "bias": 1}
    outline, layout = sharded_state.model_outline(
        model.state_dict(), names, [(0, (3, 2)), (6, (3,))]
    )
    return {"model": outline, sharded_state.MODEL_SLICES: {**layout, "slices": slices}}


def test_a_model_in_slices_reads_back_whole_and_its_folders_are_its_parts(tmp_path: Path) -> None:
    params = torch.arange(9.0)
    state = _sliced_checkpoint(tmp_path, params, 4)
    assert sharded_state.all_part_paths(state) == [
        f"step-8.pt.s{s}.dcp/{name}" for s in (0, 1) for name in (".metadata", "__0_0.distcp")
    ]
    assert sharded_state.shard_of_folder("step-8.pt.s1.dcp") == 1
    assert sharded_state.shard_of_folder("step-8.pt.g1.dcp") is None
    whole = sharded_state.fill_model(state, tmp_path)
    assert sharded_state.MODEL_SLICES not in whole
    assert torch.equal(whole["model"]["weight"], params[:6].view(3, 2))
    assert torch.equal(whole["model"]["bias"], params[6:])


def test_slices_too_short_for_the_model_are_refused(tmp_path: Path) -> None:
    state = _sliced_checkpoint(tmp_path, torch.arange(9.0), 4)
    state[sharded_state.MODEL_SLICES]["slices"].pop()  # the second owner's slice is missing
    with pytest.raises(ValueError, match="slices hold 4 elements of 'params'; it has 9"):
        sharded_state.fill_model(state, tmp_path)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda m: m["names"].update(weight=7), "names parameter 7"),
        (lambda m: m["names"].update(gone=0), "names 'gone', which it lacks"),
        (lambda m: m["params"][1].__setitem__(0, 5), "places a parameter at 5, not 6"),
        (lambda m: m["params"][0].__setitem__(1, [-1]), "gives a parameter the shape [-1]"),
        (lambda m: m["params"].__setitem__(0, None), "lays out a parameter wrongly"),
        # one slice named twice (it would be read, and held, as often as it is named)
        (lambda m: m["slices"].__setitem__(1, m["slices"][0]), "not one checkpoint's"),
        (lambda m: m["slices"].reverse(), "not one checkpoint's, in order"),
        (lambda m: m.__setitem__("slices", "x"), "names no slices"),
    ],
)
def test_an_outline_that_does_not_lay_out_its_slices_is_refused(
    tmp_path: Path, change: Any, said: str
) -> None:
    state = _sliced_checkpoint(tmp_path, torch.arange(9.0), 4)
    change(state[sharded_state.MODEL_SLICES])
    with pytest.raises(ValueError, match=re.escape(said)):
        sharded_state.fill_model(state, tmp_path)


def test_tied_parameters_share_one_tensor_in_the_parameters_dtype(tmp_path: Path) -> None:
    """A parameter named twice (tied weights) is one view, not two copies, so an outline that
    names one parameter many times cannot make a large download; each parameter comes in the
    dtype its marker names."""
    state = _sliced_checkpoint(tmp_path, torch.arange(9.0), 4)
    state["model"]["tied.weight"] = state["model"]["weight"]
    state[sharded_state.MODEL_SLICES]["names"]["tied.weight"] = 0
    state["model"]["bias"] = sharded_state.marked(torch.float64)
    whole = sharded_state.fill_model(state, tmp_path)["model"]
    assert whole["tied.weight"].data_ptr() == whole["weight"].data_ptr()
    assert whole["bias"].dtype == torch.float64 and whole["weight"].dtype == torch.float32


def test_the_outer_momentum_reads_back_from_the_slices_by_parameter(tmp_path: Path) -> None:
    state = _sliced_checkpoint(tmp_path, torch.arange(9.0), 4, momentum=-torch.arange(9.0))
    marker = sharded_state.marked(torch.float32)
    state["outer_optimizer"] = {"state": {1: {"momentum_buffer": marker}}, "param_groups": []}
    whole = sharded_state.fill_model(state, tmp_path)
    assert torch.equal(
        whole["outer_optimizer"]["state"][1]["momentum_buffer"], -torch.arange(6.0, 9.0)
    )
    state = _sliced_checkpoint(tmp_path / "b", torch.arange(9.0), 4, momentum=torch.zeros(9))
    state["outer_optimizer"] = {"state": {5: {"momentum_buffer": marker}}, "param_groups": []}
    with pytest.raises(ValueError, match="names parameter 5"):
        sharded_state.fill_model(state, tmp_path / "b")


def test_a_consolidation_of_malformed_files_says_what_is_wrong_in_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The portal's download runs ``python -m contracts.sharded_state``: a checkpoint a rank
    wrote wrongly ends it with exit code 1 and one line naming the fault (the portal's 422),
    whatever the fault raised."""
    state = _sliced_checkpoint(tmp_path, torch.arange(9.0), 4)
    state[sharded_state.MODEL_SLICES]["names"] = ["weight"]  # not a mapping
    torch.save(state, tmp_path / "step-8.pt")
    assert sharded_state.main([str(tmp_path / "step-8.pt"), str(tmp_path / "out.pt")]) == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["ValueError: the model's outline names no parameters"]
    # A slice file of the size its metadata claims but not DCP's: DCP's own error (its text
    # a traceback of every rank's failure), said by its first failure in one line.
    distcp = tmp_path / "step-8.pt.s1.dcp" / "__0_0.distcp"
    distcp.write_bytes(b"x" * distcp.stat().st_size)
    state[sharded_state.MODEL_SLICES]["names"] = {"weight": 0, "bias": 1}
    torch.save(state, tmp_path / "step-8.pt")
    assert sharded_state.main([str(tmp_path / "step-8.pt"), str(tmp_path / "out.pt")]) == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "Traceback" not in said[0], said
    assert "is not a tensor file" in said[0] and "weights_only" not in said[0], said
    assert not (tmp_path / "out.pt").exists()


def test_a_marked_entry_left_unfilled_or_slices_of_another_checkpoint_are_refused(
    tmp_path: Path,
) -> None:
    """A download never holds a marker where a tensor belongs, nor another checkpoint's
    weights under this one's name."""
    state = _sliced_checkpoint(tmp_path, torch.arange(9.0), 4)
    del state[sharded_state.MODEL_SLICES]["names"]["bias"]
    with pytest.raises(ValueError, match="leaves a marked entry unfilled"):
        sharded_state.fill_model(state, tmp_path)
    state = _sliced_checkpoint(tmp_path, torch.arange(9.0), 4)
    with pytest.raises(ValueError, match="not one checkpoint's"):
        sharded_state.fill_model(state, tmp_path, "step-12.pt")  # its slices are step-8.pt's
    state = _sliced_checkpoint(tmp_path, torch.arange(9.0), 4)
    del state[sharded_state.MODEL_SLICES]
    with pytest.raises(ValueError, match="names no slices"):
        sharded_state.fill_model(state, tmp_path)
    state = _sliced_checkpoint(tmp_path, torch.arange(9.0), 4)
    state["model"]["again"] = sharded_state.marked(torch.float64)
    state[sharded_state.MODEL_SLICES]["names"]["again"] = 0  # weight, float32 above
    with pytest.raises(ValueError, match="marks parameter 0 in two dtypes"):
        sharded_state.fill_model(state, tmp_path)


def test_two_groups_naming_one_folder_get_a_copy_each(tmp_path: Path) -> None:
    """A parked group's entry names the source group's folder: each group's state in the
    download is its own, so optimizers loaded from the two do not step one tensor."""
    tensors = {"state.0.exp_avg": torch.arange(6.0)}
    folder = tmp_path / "step-8.pt.g0.dcp"
    dcp.save(tensors, checkpoint_id=folder, no_dist=True)
    files = sorted(p.name for p in folder.iterdir())
    outline = sharded_state.outline_state(
        {"state": {0: tensors and {"exp_avg": tensors["state.0.exp_avg"]}}, "param_groups": []},
        lambda v: isinstance(v, torch.Tensor),
        folder.name,
        files,
    )
    torch.save({"model": {}, "group_optimizers": {0: outline, 1: outline}}, tmp_path / "step-8.pt")
    sharded_state.consolidate(tmp_path / "step-8.pt", tmp_path / "out.pt")
    groups = torch.load(tmp_path / "out.pt", weights_only=True)["group_optimizers"]
    a, b = (groups[g]["state"][0]["exp_avg"] for g in (0, 1))
    assert torch.equal(a, torch.arange(6.0)) and torch.equal(b, a)
    assert a.data_ptr() != b.data_ptr()
