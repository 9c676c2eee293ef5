"""[joint] in a job file: one appliance of several following a sharded job. Its rank and world come
from the layout's appliance list; its [[ring]]s are exactly that appliance's groups; every mistake
is refused naming the key."""

from __future__ import annotations

import json

import pytest
from mirrorckpt.config import shard_rules
from mirrorckpt.config.jobfile import ConfigError, dump_job, load_job
from mirrorckpt.config.layout import ParamSpec

PARAMS = [ParamSpec("w", (8, 4)), ParamSpec("b", (8,))]


def ring(group: str) -> str:
    return f'''
[[ring]]
group = "{group}"
nranks = 2
protocol = "Simple"
nccl_version = "2.21"
addresses = ["10.0.0.1", "10.0.0.2"]
'''


def write(tmp_path, joint: str, groups=("pp0-tp0-sh0",), shards=True, control="") -> object:
    layout = shard_rules.hsdp(PARAMS, 2, 3, appliances=["left", "right"])  # sh0, sh2: left; sh1: right
    (tmp_path / "shards.json").write_text(json.dumps(layout.to_dict()))
    text = "[job]\n" + ('shards = "shards.json"\n' if shards else "") + control + joint + "".join(map(ring, groups))
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_rank_and_world_come_from_the_layout(tmp_path):
    job = load_job(write(tmp_path, '[joint]\nappliance = "right"\naddress = "10.0.0.9:29400"\n', ["pp0-tp0-sh1"]))
    assert job.joint == {"appliance": "right", "address": "10.0.0.9:29400", "rank": 1, "world": 2}
    assert [rc.group for rc in job.rings] == ["pp0-tp0-sh1"]
    again = tmp_path / "again.toml"
    again.write_text(dump_job(job))
    assert load_job(again).joint == job.joint


def test_without_joint_one_serve_follows_every_ring(tmp_path):
    job = load_job(write(tmp_path, "", ["pp0-tp0-sh0", "pp0-tp0-sh1", "pp0-tp0-sh2"]))
    assert job.joint == {} and len(job.rings) == 3


LEFT = '[joint]\nappliance = "left"\naddress = "10.0.0.9:29400"\n'


@pytest.mark.parametrize("joint,groups,words", [
    (LEFT, ["pp0-tp0-sh0", "pp0-tp0-sh1", "pp0-tp0-sh2"],
     "[[ring]] #2 group: 'pp0-tp0-sh1' is followed by appliance 'right' in shards.json, not by this serve's "
     "[joint] appliance 'left'"),
    (LEFT, ["pp0-tp0-sh0"],
     "[[ring]]: appliance 'left' follows group(s) pp0-tp0-sh2 in shards.json, and no [[ring]] here follows them"),
    ('[joint]\nappliance = "middle"\naddress = "10.0.0.9:29400"\n', ["pp0-tp0-sh0"],
     "[joint] appliance: 'middle' is not an appliance of shards.json (appliances: left, right)"),
    (LEFT + "rank = 1\n", ["pp0-tp0-sh0", "pp0-tp0-sh2"],
     "[joint] rank: 1, but shards.json makes appliance 'left' rank 0"),
    (LEFT + "world = 3\n", ["pp0-tp0-sh0", "pp0-tp0-sh2"],
     "[joint] world: 3, but shards.json makes appliance 'left' world 2"),
    ('[joint]\nappliance = "left"\naddress = "10.0.0.9:0"\n', ["pp0-tp0-sh0", "pp0-tp0-sh2"],
     "[joint] address: '10.0.0.9:0': every appliance meets at this port"),
    ('[joint]\nappliance = "left"\naddress = "nowhere"\n', ["pp0-tp0-sh0", "pp0-tp0-sh2"],
     "[joint] address: expected HOST:PORT"),
    ('[joint]\naddress = "10.0.0.9:29400"\n', ["pp0-tp0-sh0", "pp0-tp0-sh2"],
     "[joint]: missing key 'appliance'"),
    (LEFT + "timeout_seconds = 0\n", ["pp0-tp0-sh0", "pp0-tp0-sh2"], "[joint] timeout_seconds:"),
])
def test_a_wrong_joint_table_is_refused_naming_the_key(tmp_path, joint, groups, words):
    with pytest.raises(ConfigError) as e:
        load_job(write(tmp_path, joint, groups))
    assert words in str(e.value)


def test_with_the_layout_from_the_trainer_rank_and_world_are_given(tmp_path):
    control = '[control]\nsecret_file = "s"\n'
    path = write(tmp_path, LEFT, [], shards=False, control=control)
    path.write_text(path.read_text() + ring("pp0-tp0-sh0") + 'listen = "127.0.0.1:7071"\n')
    with pytest.raises(ConfigError, match=r"\[joint\]: missing key 'rank' \(without \[job\] shards"):
        load_job(path)
    path.write_text(path.read_text().replace('address = "10.0.0.9:29400"\n',
                                             'address = "10.0.0.9:29400"\nrank = 2\nworld = 2\n'))
    with pytest.raises(ConfigError, match=r"\[joint\] rank: 2 is outside the appliances' group \(ranks 0..1\)"):
        load_job(path)
    path.write_text(path.read_text().replace("rank = 2", "rank = 0"))
    assert load_job(path).joint["rank"] == 0


def test_a_plain_job_has_no_joint(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[ring]\nnranks = 2\n[joint]\nappliance = "a"\naddress = "10.0.0.9:29400"\n')
    with pytest.raises(ConfigError, match=r"\[joint\]: only a sharded job \(\[\[ring\]\] tables\)"):
        load_job(path)
