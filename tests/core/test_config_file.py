"""A config file that cannot make a cluster is one ConfigError naming the key, at load."""

import pytest

from evinfra.config import load_config
from evinfra.errors import ConfigError


@pytest.mark.parametrize("toml,key,says", [
    ('[cluster]\nnodes = [{name = "a"}]\ninitial_prefill = 1', "cluster", "at least two"),
    ('[cluster]\nnodes = [{name = "a"}, {name = "a"}]\ninitial_prefill = 1', "cluster",
     "distinct"),
    ('[cluster]\nnodes = [{name = "a"}, {name = ""}]\ninitial_prefill = 1',
     "cluster.nodes.1.name", "length >= 1"),
    ('[cluster]\nnodes = [{name = "a"}, {name = "b"}]\ninitial_prefill = 2', "cluster",
     "no decode node"),
    ('[model]\ntool_call_parser = "mistral"', "model.tool_call_parser",
     "one of 'hermes', 'qwen3_coder'"),
    ('[cluster]\ndriver = "vllm"', "cluster.driver", "one of 'fake', 'sglang'"),
])
def test_a_config_that_cannot_make_a_cluster(tmp_path, toml, key, says):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.key == key and says in str(e.value) and str(path) in str(e.value)


def test_the_shipped_configs_load():
    for name in ("etc/cluster.toml", "etc/demo.toml"):
        c = load_config(name)
        assert len(c.cluster.nodes) == 9 and c.model.tool_calls == "hermes"
    c = load_config("etc/sglang.toml")  # the template for real engines
    assert c.cluster.driver == "sglang" and c.model.dir and c.cluster.page_size == 64
    assert all(n.url.startswith("http://") for n in c.cluster.nodes)
