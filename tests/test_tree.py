"""flatten_state: what becomes a tensor leaf (deferred or eager), what becomes a tree value, what is refused."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import pickle
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointing import PickleCodec, StateError
from checkpointing.format.dtypes import dtype_name
from checkpointing.errors import ManifestError
from checkpointing.format.decode import decode_manifest
from checkpointing.format.manifest import ChunkRef, Manifest, ShardEntry, TensorEntry, encode_manifest
from checkpointing.state.tree import flatten_state, join_key


def _items(node: dict) -> dict:
    """A dict node's items as a python dict (keys keep their types)."""
    assert set(node) == {"dict"}, node
    return {k: v for k, v in node["dict"]}


def _stateful_items(node: dict) -> dict:
    assert set(node) == {"stateful", "class"}, node
    return _items(node["stateful"])


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.lin(x))


def as_manifest(flat, step: int = 1) -> Manifest:
    """The manifest a save of `flat` would write (fake chunk locations and digests)."""
    tensors = []
    for i, leaf in enumerate(flat.leaves):
        shape = tuple(leaf.tensor.shape)
        n = leaf.tensor.numel() * leaf.tensor.element_size()
        chunks = (ChunkRef("step-0000000001/r00000.abc.pack", 64 * i, n, "xxh3-128:" + "0" * 32),) if n else ()
        tensors.append(TensorEntry(leaf.key, dtype_name(leaf.tensor.dtype), shape, (ShardEntry((0,) * len(shape), shape, chunks),)))
    return Manifest.single(step, flat.tree, tuple(tensors))


def assert_restorable(flat) -> None:
    """Whatever flatten_state accepts must encode and decode: otherwise a save commits an unreadable checkpoint."""
    m = as_manifest(flat)
    assert decode_manifest(encode_manifest(m), "test") == m


# ---------------------------------------------------------------- modules and optimizers


def test_module_params_deferred_buffers_eager():
    net = TinyNet()
    flat = flatten_state({"model": net})
    by_key = {leaf.key: leaf for leaf in flat.leaves}
    assert set(by_key) == {
        "model/lin.weight", "model/lin.bias", "model/bn.weight", "model/bn.bias",
        "model/bn.running_mean", "model/bn.running_var", "model/bn.num_batches_tracked",
    }
    for key in ("model/lin.weight", "model/lin.bias", "model/bn.weight", "model/bn.bias"):
        assert by_key[key].deferred, key  # parameters change only in optimizer.step()
    for key in ("model/bn.running_mean", "model/bn.running_var", "model/bn.num_batches_tracked"):
        assert not by_key[key].deferred, key  # buffers change in forward(): copied before save() returns
    node = _items(flat.tree)["model"]
    assert node["class"] == f"{TinyNet.__module__}.TinyNet"
    sd = _stateful_items(node)
    assert list(sd) == list(net.state_dict())
    for k, v in sd.items():
        leaf = flat.leaves[v["tensor"]]
        assert leaf.key == f"model/{k}"
        assert leaf.tensor.data_ptr() == net.state_dict()[k].data_ptr()  # no copy at flatten time
        assert not leaf.tensor.requires_grad
    assert flat.nbytes == sum(t.numel() * t.element_size() for t in net.state_dict().values())
    assert_restorable(flat)


def test_eager_leaves_come_out_in_state_order_and_eager_flag_defers_nothing():
    net = TinyNet()
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    flat = flatten_state({"model": net, "optim": opt}, eager=True)
    assert flat.leaves and not any(leaf.deferred for leaf in flat.leaves)
    assert_restorable(flat)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=1e-3),
    lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
])
def test_optimizer_state_is_deferred(make_opt):
    net = TinyNet()
    opt = make_opt(net.parameters())
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    flat = flatten_state({"optim": opt})
    assert flat.leaves, "an optimizer after one step has state tensors"
    assert all(leaf.deferred for leaf in flat.leaves)
    assert all(leaf.key.startswith("optim/state/") for leaf in flat.leaves)
    node = _items(flat.tree)["optim"]
    assert node["class"] == f"{type(opt).__module__}.{type(opt).__qualname__}"
    groups = _stateful_items(node)["param_groups"]
    assert "list" in groups
    assert_restorable(flat)


def test_fresh_optimizer_has_no_leaves():
    net = TinyNet()
    flat = flatten_state({"optim": torch.optim.Adam(net.parameters())})
    assert flat.leaves == []
    assert_restorable(flat)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_tied_weights_are_one_leaf_referenced_twice():
    lm = TiedLM()
    flat = flatten_state({"lm": lm})
    sd = _stateful_items(_items(flat.tree)["lm"])
    assert sd["emb.weight"] == sd["head.weight"] == {"tensor": 0}
    assert len(flat.leaves) == 1
    assert flat.leaves[0].key == "lm/emb.weight"
    assert flat.leaves[0].deferred
    assert_restorable(flat)


def test_aliases_in_plain_containers():
    t = torch.arange(12.0).reshape(3, 4)
    flat = flatten_state({"a": t, "b": [t, t.view(3, 4)], "row0": t[0], "row1": t[1], "flat": t.view(12), "tT": t.t()})
    tree = _items(flat.tree)
    assert tree["a"] == {"tensor": 0}
    assert tree["b"] == {"list": [{"tensor": 0}, {"tensor": 0}]}  # same storage, offset, shape, stride
    distinct = {tree["row0"]["tensor"], tree["row1"]["tensor"], tree["flat"]["tensor"], tree["tT"]["tensor"]}
    assert len(distinct) == 4 and 0 not in distinct  # different views are different leaves
    assert len(flat.leaves) == 5


def test_empty_tensors_are_never_aliased():
    e = torch.empty(0)
    flat = flatten_state({"a": e, "b": e})
    assert [leaf.key for leaf in flat.leaves] == ["a", "b"]
    assert_restorable(flat)


def test_top_level_tensors_are_eager_even_if_they_are_parameters():
    net = nn.Linear(2, 2)
    flat = flatten_state({"w": net.weight, "model": net})
    # the first reference decides: the alias to the top-level (eager) leaf stays eager
    assert not flat.leaves[0].deferred
    sd = _stateful_items(_items(flat.tree)["model"])
    assert sd["weight"] == {"tensor": 0}
    assert flat.leaves[1].key == "model/bias" and flat.leaves[1].deferred


# ---------------------------------------------------------------- plain values


def test_values_and_containers():
    state = {
        "step": 10,
        "neg": -(2**62),
        "lr": 0.001,
        "flag": False,
        "none": None,
        "name": "ünïcødé ✓",
        "nan": math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "negzero": -0.0,
        "blob": b"\x00\xffabc",
        "ba": bytearray(b"xy"),
        "tup": (1, "a", (2.5,)),
        "lst": [1, [2, []]],
        "ints": {1: "one", -2: "minus two", 0: {3: 4}},
        "od": OrderedDict([("z", 1), ("a", 2)]),
    }
    flat = flatten_state(state)
    assert flat.leaves == []
    tree = _items(flat.tree)
    assert list(tree) == list(state)  # insertion order kept
    assert tree["step"] == {"value": 10}
    assert tree["neg"] == {"value": -(2**62)}
    assert tree["lr"] == {"value": 0.001}
    assert tree["flag"] == {"value": False}
    assert tree["none"] == {"value": None}
    assert tree["name"] == {"value": "ünïcødé ✓"}
    assert tree["nan"] == {"float": "nan"}
    assert tree["inf"] == {"float": "inf"}
    assert tree["ninf"] == {"float": "-inf"}
    assert tree["negzero"] == {"value": -0.0} and math.copysign(1, tree["negzero"]["value"]) == -1
    assert base64.b64decode(tree["blob"]["bytes"]) == b"\x00\xffabc"
    assert base64.b64decode(tree["ba"]["bytes"]) == b"xy"
    assert tree["tup"] == {"tuple": [{"value": 1}, {"value": "a"}, {"tuple": [{"value": 2.5}]}]}
    assert tree["lst"] == {"list": [{"value": 1}, {"list": [{"value": 2}, {"list": []}]}]}
    ints = _items(tree["ints"])
    assert list(ints) == [1, -2, 0] and all(isinstance(k, int) for k in ints)
    assert _items(ints[0]) == {3: {"value": 4}}
    assert list(_items(tree["od"])) == ["z", "a"]
    assert_restorable(flat)
    # int keys survive the JSON round trip as ints, distinct from their string spelling
    m = decode_manifest(encode_manifest(as_manifest(flatten_state({1: "int", "1": "str"}))), "t")
    assert m.tree == {"dict": [[1, {"value": "int"}], ["1", {"value": "str"}]]}


def test_keys_with_slashes_are_escaped_in_leaf_keys():
    flat = flatten_state({"a/b": {"c%d": torch.zeros(1)}, 7: [torch.ones(1)]})
    assert [leaf.key for leaf in flat.leaves] == ["a%2Fb/c%25d", "7/0"]
    assert join_key(("a/b", "c%d")) == "a%2Fb/c%25d"


def test_numpy_arrays_and_scalars():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    nc = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]  # not contiguous
    state = {
        "a": a, "nc": nc, "b": np.array([True, False]), "c": np.zeros(2, dtype=np.complex64), "u": np.arange(3, dtype=np.uint16),
        "f32": np.float32(1.5), "i64": np.int64(-3), "u8": np.uint8(255), "bool": np.bool_(True), "fnan": np.float64("nan"),
        "finf": np.float32("-inf"),
    }
    flat = flatten_state(state)
    tree = _items(flat.tree)
    assert tree["a"] == {"ndarray": 0}
    assert [leaf.key for leaf in flat.leaves] == ["a", "nc", "b", "c", "u"]
    assert not any(leaf.deferred for leaf in flat.leaves)
    assert flat.leaves[0].tensor.data_ptr() == a.ctypes.data  # contiguous arrays are not copied
    assert flat.leaves[1].tensor.is_contiguous()
    assert torch.equal(flat.leaves[1].tensor, torch.from_numpy(np.ascontiguousarray(nc)))
    assert flat.leaves[2].tensor.dtype == torch.bool
    assert tree["f32"] == {"value": 1.5} and type(tree["f32"]["value"]) is float
    assert tree["i64"] == {"value": -3} and type(tree["i64"]["value"]) is int
    assert tree["u8"] == {"value": 255}
    assert tree["bool"] == {"value": True} and type(tree["bool"]["value"]) is bool
    assert tree["fnan"] == {"float": "nan"}
    assert tree["finf"] == {"float": "-inf"}
    assert_restorable(flat)


# ---------------------------------------------------------------- refused with StateError naming the key


class Opaque:
    pass


class MyTensor(torch.Tensor):
    pass


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "state, key",
    [
        ({"outer": {"s": {1, 2}}}, "outer/s"),
        ({"outer": {"fs": frozenset()}}, "outer/fs"),
        ({"obj": Opaque()}, "obj"),
        ({"lst": [1, Opaque()]}, "lst/1"),
        ({"pt": Point(1, 2)}, "pt"),
        ({"cplx": 1j}, "cplx"),
        ({"npc": np.complex64(1)}, "npc"),
        ({"fn": print}, "fn"),
        ({"sub": MyTensor(torch.zeros(2))}, "sub"),
        ({"sp": torch.zeros(3, 3).to_sparse()}, "sp"),
        ({"csr": torch.eye(3).to_sparse_csr()}, "csr"),
        ({"meta": torch.empty(2, device="meta")}, "meta"),
        ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)}, "q"),
        ({"be": np.arange(3, dtype=">i4")}, "be"),
        ({"objarr": np.array([Opaque()], dtype=object)}, "objarr"),
        ({"strarr": np.array(["a", "b"])}, "strarr"),
        *[({"deep": {"bits": torch.zeros(4, dtype=getattr(torch, name))}}, "deep/bits")
          for name in ("float4_e2m1fn_x2", "uint4", "int4", "bits8") if isinstance(getattr(torch, name, None), torch.dtype)],
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_refused_values_name_their_key(state, key):
    with pytest.raises(StateError) as info:
        flatten_state(state)
    assert key in str(info.value)
    assert isinstance(info.value, TypeError)  # StateError is also a TypeError


@pytest.mark.parametrize("bad_key", [(1, 2), 1.5, True, None, b"k", frozenset()])
def test_non_str_int_keys_are_refused(bad_key):
    with pytest.raises(StateError) as info:
        flatten_state({"outer": {"inner": {bad_key: 1}}})
    msg = str(info.value)
    assert repr(bad_key) in msg and "outer/inner" in msg


def test_root_must_be_a_mapping():
    for bad in ([1], None, torch.zeros(1), nn.Linear(1, 1)):
        with pytest.raises(StateError):
            flatten_state(bad)  # type: ignore[arg-type]


class BadStateful:
    def state_dict(self):
        return [1, 2]

    def load_state_dict(self, sd):
        pass


def test_state_dict_returning_a_non_dict():
    with pytest.raises(StateError, match="thing"):
        flatten_state({"thing": BadStateful()})


class Counter:
    """A user Stateful object (not a Module/Optimizer): its tensors are eager."""

    def __init__(self) -> None:
        self.n = 3
        self.t = torch.ones(2)

    def state_dict(self):
        return {"n": self.n, "t": self.t}

    def load_state_dict(self, sd):
        self.n, self.t = sd["n"], sd["t"]


def test_user_stateful_object():
    flat = flatten_state({"c": Counter()})
    node = _items(flat.tree)["c"]
    assert node["class"] == f"{__name__}.Counter"
    assert _stateful_items(node) == {"n": {"value": 3}, "t": {"tensor": 0}}
    assert not flat.leaves[0].deferred
    assert_restorable(flat)


# ---------------------------------------------------------------- codecs


@dataclasses.dataclass
class Config:
    name: str
    layers: int


@dataclasses.dataclass
class SubConfig(Config):
    extra: bool = True


class ConfigCodec:
    name = "config-json"
    types = (Config,)

    def encode(self, obj):
        return dataclasses.asdict(obj)

    def decode(self, data):
        return Config(**data)


class SubConfigCodec(ConfigCodec):
    name = "subconfig-json"
    types = (SubConfig,)

    def decode(self, data):
        return SubConfig(**data)


def test_json_codec_is_used_for_its_type():
    flat = flatten_state({"cfg": Config("gpt", 12), "lst": [Config("x", 1)]}, codecs=(ConfigCodec(),))
    tree = _items(flat.tree)
    assert tree["cfg"] == {"codec": "config-json", "data": {"name": "gpt", "layers": 12}}
    assert tree["lst"] == {"list": [{"codec": "config-json", "data": {"name": "x", "layers": 1}}]}
    assert ConfigCodec().decode(tree["cfg"]["data"]) == Config("gpt", 12)
    assert_restorable(flat)


def test_codec_exact_type_wins_over_isinstance():
    codecs = (ConfigCodec(), SubConfigCodec())
    tree = _items(flatten_state({"a": SubConfig("s", 2), "b": Config("c", 3)}, codecs=codecs).tree)
    assert tree["a"]["codec"] == "subconfig-json"
    assert tree["b"]["codec"] == "config-json"
    # a subclass without its own codec falls back to the isinstance match
    tree = _items(flatten_state({"a": SubConfig("s", 2)}, codecs=(ConfigCodec(),)).tree)
    assert tree["a"] == {"codec": "config-json", "data": {"name": "s", "layers": 2, "extra": True}}


def test_without_a_codec_the_dataclass_is_refused():
    with pytest.raises(StateError, match="cfg"):
        flatten_state({"cfg": Config("gpt", 12)})


def test_pickle_codec():
    codec = PickleCodec(Config, Opaque)
    flat = flatten_state({"cfg": Config("gpt", 12), "pt": Point(1, 2)}, codecs=(codec, PickleCodec(Point)))
    tree = _items(flat.tree)
    assert tree["cfg"]["codec"] == "pickle"
    assert codec.decode(tree["cfg"]["data"]) == Config("gpt", 12)
    assert pickle.loads(base64.b64decode(tree["pt"]["data"])) == Point(1, 2)
    json.dumps(flat.tree)
    with pytest.raises(ValueError):
        PickleCodec()


def test_codec_returning_non_json_data_is_a_state_error():
    class Bad(ConfigCodec):
        name = "bad"

        def encode(self, obj):
            return {"t": torch.zeros(1)}

    class Nan(ConfigCodec):
        name = "nan"

        def encode(self, obj):
            return {"x": math.nan}

    for codec in (Bad(), Nan()):
        with pytest.raises(StateError, match="cfg"):
            flatten_state({"cfg": Config("a", 1)}, codecs=(codec,))


def test_codec_takes_precedence_over_state_dict():
    class CounterCodec:
        name = "counter"
        types = (Counter,)

        def encode(self, obj):
            return {"n": obj.n}

        def decode(self, data):
            c = Counter()
            c.n = data["n"]
            return c

    flat = flatten_state({"c": Counter()}, codecs=(CounterCodec(),))
    assert _items(flat.tree)["c"] == {"codec": "counter", "data": {"n": 3}}
    assert flat.leaves == []


# ---------------------------------------------------------------- what is accepted is restorable


def _nested(depth: int) -> dict:
    d: dict = {"leaf": 1}
    for _ in range(depth):
        d = {"k": d}
    return d


@pytest.mark.parametrize("depth", [10, 60, 64, 100])
def test_deep_states_are_refused_at_save_or_restorable(depth):
    """flatten_state must not accept a state whose manifest the reader then refuses (MAX_TREE_DEPTH)."""
    try:
        flat = flatten_state({"root": _nested(depth)})
    except StateError:
        return
    assert_restorable(flat)


@pytest.mark.parametrize(
    "value",
    [10**5000, "lone surrogate \ud800"],
    ids=["int-with-5000-digits", "lone-surrogate"],
)
def test_unencodable_values_are_refused_at_save_or_restorable(value):
    """flatten_state promises StateError for anything that cannot be checkpointed."""
    try:
        flat = flatten_state({"x": value})
    except StateError as exc:
        assert "x" in str(exc)
        return
    assert_restorable(flat)


json_keys = st.text(max_size=6) | st.integers(-1000, 1000)
scalars = (
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=8) | st.binary(max_size=8)
)
tensors = st.builds(
    lambda shape, dt: torch.zeros(shape, dtype=dt),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.uint8]),
)
states = st.dictionaries(
    json_keys,
    st.recursive(
        scalars | tensors | st.builds(lambda n: np.zeros(n, dtype=np.int16), st.integers(0, 4)),
        lambda inner: st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(json_keys, inner, max_size=3),
        max_leaves=12,
    ),
    max_size=5,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states, st.booleans())
def test_random_states_flatten_to_restorable_manifests(state, eager):
    flat = flatten_state(state, eager=eager)
    assert not any(leaf.deferred for leaf in flat.leaves)  # nothing here is a Module/Optimizer
    assert_restorable(flat)
    # every leaf is referenced from the tree, and every reference is to a leaf
    refs = set()

    def walk(node):
        if "tensor" in node or "ndarray" in node:
            refs.add(node.get("tensor", node.get("ndarray")))
        for child in node.get("dict", []):
            walk(child[1])
        for child in node.get("list", node.get("tuple", [])):
            walk(child)

    walk(flat.tree)
    assert refs == set(range(len(flat.leaves)))


@pytest.mark.parametrize("bad, said", [([1], "is not a codec"), ([PickleCodec], "PickleCodec is a class; pass an instance"),
                                       (PickleCodec(dict), "pass a list of codec objects"), (["pickle"], "is not a codec"),
                                       (3, "pass a list of codec objects")])
def test_codecs_that_are_not_a_list_of_codec_objects_are_refused_with_an_example(tmp_path, bad, said):
    from checkpointing import CheckpointConfigError, CheckpointManager

    with pytest.raises(CheckpointConfigError, match=said):
        CheckpointManager(tmp_path / "ck", codecs=bad)
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").glob("step-*"))


def test_a_container_that_holds_itself_or_nests_too_deep_is_refused_by_key():
    looped: dict = {"lr": 0.1}
    looped["self"] = looped
    listed: list = [1]
    listed.append(listed)
    deep: list = []
    node = deep
    for _ in range(3000):
        node.append([])
        node = node[0]
    for value in (looped, listed, deep):
        with pytest.raises(StateError, match=r"state\['cfg/.*'\.\.\.\] nests deeper than 64 levels \(does a dict or list hold itself\?\)"):
            flatten_state({"cfg": value})
