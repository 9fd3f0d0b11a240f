"""What plan files and `neorec plan` refuse, and what they say: a node kind given ranks, no kinds to
plan with, a hand-edited plan file that kept its checksum, an SSD piece that fits nowhere."""

from __future__ import annotations

import json

import pytest

from neorec.distributed.plan import ShardingPlan, TablePlan
from neorec.distributed.topology import Topology
from neorec.embedding.tables import TableConfig
from neorec.errors import ConfigError
from neorec.planner import build_workload, plan_sharding, this_machine
from neorec.planner.hardware import CALIBRATED_CPU

TABLES = [
    TableConfig(name="t", rows=1000, dim=16, features=["f"]),
    TableConfig(name="u", rows=10, dim=8, features=["g"]),
]


@pytest.mark.parametrize("kind", ["twrw", "twcw"])
def test_a_node_kind_with_ranks_is_refused_naming_the_table(kind):
    entries = {"t": {"kind": kind, "node": 0, "ranks": [1]}, "u": {"kind": "tw", "ranks": [0]}}
    plan = ShardingPlan.from_dict({"tables": entries})
    with pytest.raises(ConfigError, match=rf"table 't' \({kind}\).*take 'node'.*not 'ranks'"):
        plan.validate(TABLES, Topology(2, 0, 2))
    del plan.tables["t"].ranks[:]  # the same entry without ranks is a plan
    plan.validate(TABLES, Topology(2, 0, 2))


def test_plan_with_no_kinds_is_an_error_naming_kinds():
    from neorec.train.run_plan import plan_command

    with pytest.raises(ConfigError, match=r"no sharding kinds.*--kinds.*distributed\.kinds"):
        plan_command(None, model="12t", kinds=())


@pytest.mark.parametrize("kinds", ["", " , "])
def test_neorec_plan_with_kinds_naming_none_is_one_line(kinds, capsys):
    from neorec.cli import main

    assert main(["plan", "--kinds", kinds]) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: --kinds") and "names no sharding kind" in err and "--set" not in err


def test_a_hand_edited_plan_file_that_kept_its_crc32_says_to_delete_it(tmp_path):
    path = tmp_path / "plan.json"
    ShardingPlan({"t": TablePlan("rw", [0, 1]), "u": TablePlan("tw", [1])}).save(path)
    data = json.loads(path.read_text())
    data["tables"]["u"]["ranks"] = [0]  # edited by hand, checksum kept
    path.write_text(json.dumps(data))
    deleted = r"checksum mismatch.*edited by hand is accepted once its 'crc32' key is deleted"
    with pytest.raises(ConfigError, match=deleted):
        ShardingPlan.load(path)
    del data["crc32"]
    path.write_text(json.dumps(data))
    assert ShardingPlan.load(path).tables["u"].ranks == [0]


def test_other_damage_to_a_plan_file_does_not_suggest_deleting_the_checksum(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"tables": {"t": {"kind": "tw", "ranks": [0]}}, "crc23": 5}')
    with pytest.raises(ConfigError, match="unknown key") as e:
        ShardingPlan.load(path)
    assert "deleted" not in str(e.value)


def _fits_nowhere(memory: int, disk: int) -> str:
    cluster = this_machine(2, calibration=dict(CALIBRATED_CPU), memory=memory, disk=disk)
    table = TableConfig(name="huge", rows=10**9, dim=64, features=["f"])  # 256 GB of sgd rows
    with pytest.raises(ConfigError, match="fits nowhere") as e:
        plan_sharding(build_workload([table], "sgd", 64), cluster, time_budget=1.0)
    return str(e.value).split("ways out:")[1]


def test_an_ssd_piece_short_of_disk_suggests_a_smaller_write_log_not_a_smaller_cache():
    ways = _fits_nowhere(memory=2**37, disk=2**38)  # a cache fits in RAM; on disk, rows and log do not
    assert "embedding.cache.ssd_log, now 1" in ways
    assert "embedding.cache.fraction" not in ways


def test_an_ssd_piece_short_of_memory_for_its_cache_suggests_a_smaller_cache():
    ways = _fits_nowhere(memory=2**33, disk=2**42)  # files fit on disk, a cache does not in RAM
    assert "embedding.cache.fraction, now 0.2" in ways
    assert "ssd_log" not in ways
