"""Slurm host lists: expansion (what Slurm prints) and compression (what trainpod writes)."""

from __future__ import annotations

import pytest

from trainpod.slurm.hostlist import MAX_HOSTS, HostlistError, compress, expand


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[1-2,7],gpu-a", ["node1", "node2", "node7", "gpu-a"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("rack[1-2]-gpu", ["rack1-gpu", "rack2-gpu"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a[1-2]b[3,5]c", ["a1b3c", "a1b5c", "a2b3c", "a2b5c"]),
        ("node[1-3],node2", ["node1", "node2", "node3"]),
        (" node[1-2] ", ["node1", "node2"]),
        ("", []),
    ],
)
def test_host_lists_expand_and_compress_back(text: str, hosts: list[str]) -> None:
    assert expand(text) == hosts
    assert sorted(expand(compress(hosts))) == sorted(hosts)


@pytest.mark.parametrize(
    ("hosts", "text"),
    [
        (["node1", "node2", "node3"], "node[1-3]"),
        (["n08", "n09", "n10"], "n[08-10]"),
        (["g1", "g2", "cpu-0"], "cpu-0,g[1-2]"),
        (["n1", "n3", "n2", "n1"], "n[1-3]"),
        (["rack1-n01", "rack1-n02", "rack2-n01"], "rack1-n[01-02],rack2-n01"),
        (["login"], "login"),
        ([], ""),
    ],
)
def test_compression_writes_one_sorted_group_per_prefix(hosts: list[str], text: str) -> None:
    assert compress(hosts) == text


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("node[3-1]", "descending"),
        ("node[a-b]", "bad range"),
        ("node[]", "bad range"),
        ("node[1-2", "unclosed"),
        ("node[1-2]]", "without"),
        ("node[[1]]", "nested"),
        ("a,,b", "empty name"),
        (",a", "empty name"),
        ("a,", "empty name"),
        (f"n[1-{MAX_HOSTS + 1}]", "over"),
        ("a[1-1000]b[1-1000]", "over"),
    ],
)
def test_bad_host_lists_say_what_is_wrong(bad: str, why: str) -> None:
    with pytest.raises(HostlistError, match=f"{why}.*host list|host list.*{why}"):
        expand(bad)
