"""``evinfra partitions nginx``: the config it writes (nginx itself checks it when installed)
and the one-line errors of a bad ``partitions.toml``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from evinfra.cli import main
from evinfra.partitions.config import load_partitions
from evinfra.partitions.identity import IDENTITY_HEADERS
from evinfra.partitions.nginx import render

ROOT = Path(__file__).resolve().parents[2]
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def test_the_shipped_config_renders_every_partition_on_a_consistent_ring():
    cfg = load_partitions(ROOT / "etc/partitions.toml")
    text = render(cfg)
    assert "hash $evinfra_agent consistent;" in text
    servers = re.findall(r"^\s+server (\S+) max_fails=1 fail_timeout=10s;", text, re.M)
    assert servers == [p.address for p in cfg.partitions] and len(servers) == 3
    assert "proxy_buffering off;" in text and "proxy_next_upstream error timeout;" in text
    for p in cfg.partitions:  # the operator's start line for each
        assert f"evinfra serve --config {p.config} --host {p.host} --port {p.port}" in text


def test_the_maps_read_the_identity_headers_in_the_partitions_order():
    text = render(load_partitions(ROOT / "etc/partitions.toml"))
    chain, var = [], "$evinfra_agent"
    sources = {t: s for s, t in re.findall(r"map (\$\S+) (\$\S+) \{", text)}
    fallback = dict(re.findall(r"map \$\S+ (\$\S+) \{\n\s+\"\"\s+(\$\S+);", text))
    while var in sources:
        chain.append(sources[var])
        var = fallback[var]
    chain.append(var)
    assert chain == ["$http_" + h.lower().replace("-", "_") for h in IDENTITY_HEADERS]


@pytest.mark.skipif(NGINX is None, reason="no nginx (scripts/install-nginx.sh)")
def test_nginx_accepts_the_written_config(tmp_path):
    out = tmp_path / "nginx.conf"
    assert main(["partitions", "nginx", "--config", str(ROOT / "etc/partitions.toml"),
                 "--out", str(out)]) == 0
    r = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-c", "nginx.conf", "-e", "stderr"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("text, says", [
    ("[[partitions]]\nname = 'a'\nport = 1\n[[partitions]]\nname = 'b'\nport = 1\n",
     "share the address 127.0.0.1:1"),
    ("[[partitions]]\nname = 'a'\nport = 1\nweight = 2\n", "unknown field `weight`"),
    ("[nginx]\nport = 80\n", "missing required field `partitions`"),
    ("partitions = []\n", "length >= 1"),
    ("[[partitions]]\nname = 'a b'\nport = 1\n", "partitions.0.name"),
    ("[[partitions\n", "not valid TOML"),
])
def test_a_bad_partitions_file_is_one_line_and_status_2(tmp_path, capsys, text, says):
    f = tmp_path / "p.toml"
    f.write_text(text)
    assert main(["partitions", "nginx", "--config", str(f)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and says in err, err
