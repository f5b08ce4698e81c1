"""Reading a state folder (contracts/sharded_state.py) trusts nothing in it: its files come
from ranks that run user code, and the portal reads them to build a download."""

import dataclasses
import pickle
from pathlib import Path

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
