"""A streamed weight sync: the manifest (the trainer's ``weight_shapes()``) is checked before any
tensor is read, then the export is read one tensor at a time, each verified against its entry.

``StreamRecordingEngine`` is a fake engine (no model): it runs core's real checks
(:func:`~trellis.interfaces.weights.prepare_update`) and records what reached its "load" and when;
what is tested here is the order of reading, checking and loading. The real engines are run on
streamed updates in tests/vllm, tests/sglang and tests/hf.
"""

from __future__ import annotations

import pytest
import torch

from trellis.interfaces.rollout import RolloutEngine, sync_engine
from trellis.interfaces.weights import WeightSyncError, prepare_update
from trellis.runtime.controller import LocalController

EXPECTED = {
    "model.embed_tokens.weight": (10, 4),
    "model.layers.0.self_attn.q_proj.weight": (4, 4),
    "model.layers.0.self_attn.k_proj.weight": (2, 4),
    "model.layers.0.self_attn.v_proj.weight": (2, 4),
    "model.norm.weight": (4,),
    "lm_head.weight": (10, 4),
}
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


class Export:
    """A trainer's export as a generator that counts the tensors it has produced."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.float32) -> None:
        self.shapes = dict(shapes)
        self.dtype = dtype
        self.produced = 0

    def __iter__(self):
        for k, (name, shape) in enumerate(self.shapes.items()):
            self.produced += 1
            yield name, torch.full(shape, float(k), dtype=self.dtype)


class StreamRecordingEngine(RolloutEngine):
    """Fake engine: core's checks on the update, then a "load" that records each tensor's name and
    how many the export had produced when it arrived."""

    def __init__(self, export: Export | None = None, weight_dtype: torch.dtype | None = None) -> None:
        self.export = export
        self.weight_dtype = weight_dtype
        self.loaded: list[tuple[str, int]] = []
        self.tensors: dict[str, torch.Tensor] = {}

    def generate(self, prompts, params):
        raise AssertionError("not called")

    def load_weights(self, weights, shapes=None):
        for name, tensor in prepare_update(weights, EXPECTED, TIED, shapes=shapes).tensors:
            self.loaded.append((name, self.export.produced if self.export else -1))
            self.tensors[name] = tensor


def without(name: str) -> dict[str, tuple[int, ...]]:
    return {k: v for k, v in EXPECTED.items() if k != name}


def test_the_export_is_read_one_tensor_at_a_time_as_the_engine_loads():
    export = Export(EXPECTED)
    engine = StreamRecordingEngine(export)
    sync_engine(engine, iter(export), shapes=export.shapes)
    assert engine.loaded == [(name, k + 1) for k, name in enumerate(EXPECTED)]  # tensor k loaded when k were produced


def test_the_whole_update_path_reads_everything_first():
    """shapes=None (third-party callers, a list): today's path, the update materialised then checked."""
    export = Export(EXPECTED)
    engine = StreamRecordingEngine(export)
    engine.load_weights(iter(export))
    assert engine.loaded == [(name, len(EXPECTED)) for name in EXPECTED]


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ({**without("model.norm.weight"), "model.norm.weigth": (4,)},
         r"unknown parameter 'model.norm.weigth'; the engine's closest names: \['model.norm.weight'"),
        ({**EXPECTED, "model.norm.weight": (5,)}, r"'model.norm.weight' has shape \(5,\), the engine expects \(4,\)"),
        (without("model.layers.0.self_attn.k_proj.weight"),
         r"module 'model.layers.0.self_attn.qkv_proj' is updated only in part; missing \['model.layers.0.self_attn.k_proj.weight'\]"),
    ],
    ids=["unknown", "shape", "partial-fused"],
)  # fmt: skip
def test_a_refused_manifest_loads_nothing_and_never_reads_the_export(manifest, message):
    export = Export(manifest)
    engine = StreamRecordingEngine(export)
    with pytest.raises(WeightSyncError, match=message):
        engine.load_weights(iter(export), shapes=manifest)
    assert export.produced == 0 and engine.loaded == []


def stream(pairs):
    yield from pairs


@pytest.mark.parametrize(
    ("sent", "message"),
    [
        ([("model.norm.weight", torch.zeros(4))], r"tensor 1 is 'model.norm.weight', the manifest has 'model.embed_tokens.weight' there"),
        ([("model.embed_tokens.weight", torch.zeros(10, 5))],
         r"'model.embed_tokens.weight' arrived with shape \(10, 5\), the manifest says \(10, 4\)"),
        ([("model.embed_tokens.weight", torch.zeros(10, 4, dtype=torch.long))],
         r"'model.embed_tokens.weight' has dtype torch.int64; the engine's weights are floating point"),
        ([("model.embed_tokens.weight", torch.zeros(10, 4))], r"the stream ended after 2 of 3 tensors, before 'model.norm.weight'"),
        ([("model.embed_tokens.weight", torch.zeros(10, 4)), ("model.norm.weight", torch.zeros(4)), ("model.norm.weight", torch.zeros(4))],
         r"tensor 4 'model.norm.weight' is past the manifest's 3"),
    ],
    ids=["order", "shape", "dtype", "short", "long"],
)  # fmt: skip
def test_a_tensor_that_disagrees_with_the_manifest_mid_stream_is_named(sent, message):
    manifest = {"model.embed_tokens.weight": (10, 4), "model.norm.weight": (4,)}  # the head comes with the embedding: 3 tensors
    engine = StreamRecordingEngine()
    with pytest.raises(WeightSyncError, match=message) as err:
        engine.load_weights(stream(sent), shapes=manifest)
    assert "a backend bug" in str(err.value) or "floating point" in str(err.value)


def test_a_tied_head_missing_from_the_manifest_streams_right_after_the_embedding():
    manifest = without("lm_head.weight")
    export = Export(manifest)
    engine = StreamRecordingEngine(export)
    engine.load_weights(iter(export), shapes=manifest)
    names = [name for name, _ in engine.loaded]
    assert names[:2] == ["model.embed_tokens.weight", "lm_head.weight"] and engine.loaded[1][1] == 1  # before the next is produced
    assert engine.tensors["lm_head.weight"] is engine.tensors["model.embed_tokens.weight"]


def test_the_manifest_is_checked_when_the_update_is_prepared_not_when_first_read():
    with pytest.raises(WeightSyncError, match="unknown parameter 'x'"):
        prepare_update(iter(()), EXPECTED, TIED, shapes={"x": (1,)})


class StreamingActor:
    """Stands in for the actor's one-rank worker group: the worker's export and manifest verbs."""

    def __init__(self) -> None:
        self.workers = [self]
        self.export = Export(EXPECTED)
        self.calls: list[tuple] = []

    def export_weights(self, bucket_bytes: int = 64 << 20, all_ranks: bool = False, dtype: torch.dtype | None = None):
        self.calls.append(("export_weights", all_ranks, dtype))
        self.export.dtype = dtype or torch.float32
        return ([pair] for pair in self.export)  # one-tensor buckets, produced lazily

    def weight_shapes(self):
        self.calls.append(("weight_shapes",))
        return self.export.shapes

    def full_module(self):
        return None  # nothing to lend: the engine keeps its weights and takes syncs


def test_the_local_sync_exports_in_the_engines_dtype_and_streams_against_the_manifest():
    actor = StreamingActor()
    engine = StreamRecordingEngine(actor.export, weight_dtype=torch.bfloat16)
    ctrl = LocalController()
    ctrl.spawn_rollout(lambda: engine, actor).sync_weights(version=1)
    assert actor.calls == [("weight_shapes",), ("export_weights", True, torch.bfloat16)]
    assert engine.loaded == [(name, k + 1) for k, name in enumerate(EXPECTED)]
    assert {t.dtype for t in engine.tensors.values()} == {torch.bfloat16}


def test_weight_buckets_hold_at_most_the_limit_and_read_lazily() -> None:
    """Buckets of at most ``bucket_bytes`` (a larger tensor alone), in order; the items are taken
    one bucket ahead at most, so an exporter gathering as it is read holds one bucket."""
    from trellis.interfaces.backend import weight_buckets

    sizes = [4, 4, 10, 2, 2, 2]  # float32 elements: 16, 16, 40, 8, 8, 8 bytes
    produced: list[str] = []

    def items():
        for i, n in enumerate(sizes):
            produced.append(f"t{i}")
            yield f"t{i}", torch.zeros(n)

    buckets = weight_buckets(items(), bucket_bytes=32)
    first = next(buckets)
    assert [n for n, _ in first] == ["t0", "t1"] and produced == ["t0", "t1", "t2"]
    rest = [[n for n, _ in b] for b in buckets]
    assert rest == [["t2"], ["t3", "t4", "t5"]]
