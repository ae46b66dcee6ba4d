"""The Redis users of docs/redis-acl.md, read from the document itself: ``acl_rules``
(role -> its ACL SETUSER line) and ``set_users`` (all of them on every node of a
private server, tests/support/redis_cluster.py), on either pool layout."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "redis-acl.md"
PASSWORD = "test-password-0123"


def acl_rules(layout: str) -> dict[str, str]:
    """role -> its ACL SETUSER line, from the fenced blocks of the doc: ``acl ROLE``
    (standalone) or ``acl ROLE cluster``."""
    pattern = r"```acl ([\w-]+)( cluster)?\n(ACL SETUSER [^\n]+)\n```"
    blocks = re.findall(pattern, DOC.read_text())
    return {
        role: line.replace("CHANGE-ME", PASSWORD)
        for role, cluster, line in blocks
        if bool(cluster) == (layout == "cluster")
    }


def set_users(server, layout: str) -> None:
    """Every role's user on every node of ``server`` (ACL rules are per node)."""
    for node in server.nodes:
        admin = node.client()
        for line in acl_rules(layout).values():
            admin.execute_command(*line.split())
        admin.close()


def role_url(server, role: str) -> str:
    """``server``'s URL as the user of ``role``."""
    return server.url.replace("://", f"://lorapool-{role}:{PASSWORD}@", 1)
