"""The state hand-over's manifest: what travels, what is refused, what a reader accepts.

The transfer itself (gloo send/recv between real processes) is in
tests/integration/test_handover_gloo.py and, end to end under frforensics-run,
tests/integration/test_launcher.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from frforensics.recovery import _handover as ho


def _state() -> dict[str, Any]:
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),  # int keys (param ids), tensors and plain values
        "step": 7, "lr": 0.5, "name": "run", "done": False, "none": None,
        "rng": torch.get_rng_state(),
        "pair": (torch.zeros(0), [torch.tensor(3, dtype=torch.int64), 1.5]),
        "dtypes": {d: torch.ones(2, 2, dtype=getattr(torch, d))
                   for d in ("float16", "bfloat16", "bool", "int8", "complex64")},
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a, b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def test_a_state_round_trips_through_its_manifest_and_its_tensors() -> None:
    state = _state()
    manifest, tensors = ho.flatten(state, version=12)
    again = ho.Manifest.loads(manifest.dumps())
    assert again == manifest and again.version == 12
    # the receiver's side: tensors rebuilt from the manifest's dtypes/shapes, bytes copied
    rebuilt = [torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in again.tensors]
    for dst, src in zip(ho._byte_views(rebuilt), ho._byte_views(tensors), strict=True):
        dst.copy_(src)
    assert _equal(ho.unflatten(again, rebuilt), state)


def test_int_keys_and_tuples_keep_their_types() -> None:
    manifest, tensors = ho.flatten({"state": {0: {"step": 1}}, "t": (1, 2)}, version=0)
    out = ho.unflatten(ho.Manifest.loads(manifest.dumps()), tensors)
    assert out == {"state": {0: {"step": 1}}, "t": (1, 2)}
    assert list(out["state"]) == [0]


@pytest.mark.parametrize(("state", "message"), [
    ({"s": {1, 2}}, "leaf at s is a set"),
    ({"b": b"raw"}, "leaf at b is a bytes"),
    ({"d": {(1, 2): 3}}, "keys must be str or int"),
    ({"sparse": torch.eye(2).to_sparse()}, "only dense tensors"),
], ids=["set", "bytes", "tuple-key", "sparse"])
def test_what_cannot_travel_is_refused_with_its_path(state: dict[str, Any], message: str) -> None:
    with pytest.raises(ho.HandoverError, match=message):
        ho.flatten(state, version=0)


def test_a_state_that_is_not_a_dict_is_refused() -> None:
    with pytest.raises(ho.HandoverError, match="must return a dict"):
        ho.flatten([torch.zeros(1)], version=0)  # type: ignore[arg-type]


def _doc() -> dict[str, Any]:
    manifest, _ = ho.flatten({"w": torch.zeros(2, 3), "step": 3}, version=5)
    return dict(json.loads(manifest.dumps()))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(schema="other"), "no schema"),
    (lambda d: d.update(version=-1), "version is -1"),
    (lambda d: d.update(version=True), "version is True"),
    (lambda d: d.update(tensors={}), "tensors is not a list"),
    (lambda d: d["tensors"][0].__setitem__(1, "object"), "dtype 'object'"),
    (lambda d: d["tensors"][0].__setitem__(2, [2, -3]), "shape"),
    (lambda d: d["tensors"][0].__setitem__(3, 10**12), "nbytes"),
    (lambda d: d["tensors"][0].__setitem__(0, [{"x": 1}]), "path"),
    (lambda d: d.update(tree={"t": 5}), "names tensor 5"),
    (lambda d: d.update(tree={"x": []}), "unknown tag"),
    (lambda d: d.update(tree={"d": [["k", {"v": {"nested": 1}}]]}), "plain leaf of type dict"),
    (lambda d: d.update(tree={"d": [[1.5, {"v": 1}]]}), "dict entry"),
], ids=["schema", "version-negative", "version-bool", "tensors-type", "dtype", "shape",
        "nbytes", "path", "tensor-index", "tag", "plain-leaf", "key-type"])
def test_a_malformed_manifest_is_one_clear_error(edit: Any, message: str) -> None:
    doc = _doc()
    edit(doc)
    with pytest.raises(ho.HandoverError, match=message):
        ho.Manifest.loads(json.dumps(doc))


def test_a_deep_or_huge_manifest_is_refused_within_bounds() -> None:
    deep: dict[str, Any] = {"v": 1}
    for _ in range(ho.MAX_DEPTH + 2):
        deep = {"l": [deep]}
    doc = _doc()
    doc["tree"] = deep
    with pytest.raises(ho.HandoverError, match="deeper than"):
        ho.Manifest.loads(json.dumps(doc))
    with pytest.raises(ho.HandoverError, match="bytes"):
        ho.Manifest.loads(b" " * (ho.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(ho.HandoverError, match="not JSON"):
        ho.Manifest.loads(b"{nope")


def test_a_standby_whose_model_differs_is_told_which_tensors() -> None:
    sender, _ = ho.flatten({"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1)},
                           version=3)
    standby, _ = ho.flatten({"a": torch.zeros(3, 2), "b": torch.zeros(4, dtype=torch.float64),
                             "d": torch.zeros(1)}, version=0)
    why = ho.mismatch(sender, standby)
    assert why is not None
    assert "d (float32[1]) is not in the survivor's state" in why
    assert "the survivor's c (float32[1]) is not in this standby's state" in why
    assert "a: the survivor's is float32[2, 3], this standby's float32[3, 2]" in why
    assert "b: the survivor's is float32[4], this standby's float64[4]" in why


def test_plain_values_may_differ_between_sender_and_standby() -> None:
    sender, _ = ho.flatten({"w": torch.ones(2), "step": 40, "lr": 0.1}, version=40)
    standby, _ = ho.flatten({"w": torch.zeros(2), "step": 0, "lr": 0.5}, version=0)
    assert ho.mismatch(sender, standby) is None


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=30), chunk=st.integers(1, 4096))
def test_chunks_cover_every_byte_once_and_never_exceed_the_chunk(sizes: list[int],
                                                                 chunk: int) -> None:
    covered = [0] * len(sizes)
    for pieces in ho._chunks(sizes, chunk):
        assert 0 < sum(n for _, _, n in pieces) <= chunk
        for i, start, n in pieces:
            assert start == covered[i] and n > 0  # in order, no gap, no overlap
            covered[i] += n
    assert covered == sizes
