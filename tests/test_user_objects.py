"""The user's own objects in the state: codecs for subclasses of plain types, Statefuls that are dicts,
and what a user's codec or state_dict()/load_state_dict() raises, named by key (1 process and 2 ranks)."""

from __future__ import annotations

import collections
import enum

import pytest
import torch

import checkpointing
from checkpointing import CheckpointError, CheckpointManager, CheckpointMismatchError
from checkpointing.errors import StateError

from _dist import run_ranks


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class EnumCodec:
    name, types = "level", (Level,)

    def encode(self, obj):
        return obj.name

    def decode(self, data):
        return Level[data]


class OrderedCodec:
    name, types = "ordered", (collections.OrderedDict,)

    def encode(self, obj):
        return [[k, v] for k, v in obj.items()]

    def decode(self, data):
        return collections.OrderedDict((k, v) for k, v in data)


class Registry(dict):
    """A dict that is also a Stateful: its state_dict() holds what the dict alone does not (its version)."""

    def __init__(self, version: int = 0) -> None:
        super().__init__()
        self.version = version

    def state_dict(self):
        return {"items": dict(self), "version": self.version}

    def load_state_dict(self, sd):
        self.clear()
        self.update(sd["items"])
        self.version = sd["version"]


def test_a_codec_for_a_subclass_of_a_plain_type_is_used_and_a_stateful_dict_saves_its_state(tmp_path):
    reg = Registry(42)
    reg["a"] = 1
    codecs = [EnumCodec(), OrderedCodec()]
    with CheckpointManager(tmp_path, codecs=codecs) as mgr:
        mgr.save(1, {"level": Level.HIGH, "od": collections.OrderedDict(b=1, a=2), "reg": reg}).wait()
        got = checkpointing.load(tmp_path, 1, codecs=codecs)
        assert got["level"] is Level.HIGH and type(got["od"]) is collections.OrderedDict and list(got["od"]) == ["b", "a"]
        assert got["reg"] == {"items": {"a": 1}, "version": 42}
        target = {"level": Level.LOW, "od": None, "reg": Registry()}
        assert mgr.restore(target) == 1
    assert target["level"] is Level.HIGH and target["reg"].version == 42 and dict(target["reg"]) == {"a": 1}


class KeyCodec:
    name, types = "vocab", (set,)

    def encode(self, obj):
        return {i: w for i, w in enumerate(sorted(obj))}  # int keys: JSON would turn them into strings

    def decode(self, data):
        return set(data.values())


class Broken:
    def state_dict(self):
        raise RuntimeError("boom in state_dict")

    def load_state_dict(self, sd):
        raise ValueError("bad state")


def test_what_a_users_codec_or_state_dict_raises_at_save_names_the_key(tmp_path):
    with CheckpointManager(tmp_path, codecs=[KeyCodec()]) as mgr:
        with pytest.raises(StateError, match=r"codec 'vocab' returned non-JSON data for state\['v'\]: the dict key 0 \(int\) is not a str"):
            mgr.save(1, {"v": {"a", "b"}})
        with pytest.raises(StateError, match=r"state\['obj'\]\.state_dict\(\) \(.*Broken\) raised RuntimeError: boom in state_dict"):
            mgr.save(1, {"obj": Broken()})


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


class Failing(Counter):
    def load_state_dict(self, sd):
        raise ValueError("this object refuses the state")


def test_what_a_users_decode_or_load_state_dict_raises_at_restore_names_the_key(tmp_path):
    class Renamed(EnumCodec):
        def decode(self, data):
            return {"LOW": Level.LOW}[data]  # a codec changed since the save: it no longer knows HIGH

    with CheckpointManager(tmp_path, codecs=[EnumCodec()]) as mgr:
        mgr.save(1, {"level": Level.HIGH, "obj": Counter()}).wait()
    with CheckpointManager(tmp_path, codecs=[Renamed()], read_only=True) as mgr:
        with pytest.raises(CheckpointMismatchError, match=r"level: codec 'level' could not decode the saved value \(KeyError: 'HIGH'\)"):
            mgr.restore({"level": None, "obj": Counter()})
    with CheckpointManager(tmp_path, codecs=[EnumCodec()], read_only=True) as mgr:
        with pytest.raises(CheckpointError, match=r"obj: Failing\.load_state_dict\(\) raised ValueError: this object refuses"):
            mgr.restore({"level": None, "obj": Failing()})


def _one_rank_refuses(rank: int, world: int, root: str) -> str:
    with CheckpointManager(f"{root}/rank{rank}", timeout_s=120) as mgr:
        mgr.save(1, {"obj": Counter()}).wait()
        try:
            mgr.restore({"obj": Failing() if rank == 0 else Counter()})
        except CheckpointError as exc:
            return f"{type(exc).__name__}: {exc}"
    return "restored"


def test_a_load_state_dict_that_raises_on_one_rank_stops_every_rank_at_once(tmp_path):
    """Not after timeout_s in the next collective call, blaming the rank that raised (timeout_s=120 here: a hang fails)."""
    got = run_ranks(_one_rank_refuses, 2, str(tmp_path), tmp=tmp_path, timeout=100)
    assert got[0].startswith("CheckpointError: obj: Failing.load_state_dict() raised ValueError"), got
    assert got[1].startswith("CheckpointError: restoring step 1 failed on rank 0"), got
