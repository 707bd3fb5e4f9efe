"""coordinator.server.clients: named client tokens, read and matched; who may see which job."""

from __future__ import annotations

import pytest

from coordinator.jobs.manager import ADMIN_POLICY
from coordinator.scheduling.shares import ClientPolicy
from coordinator.server.clients import EVERYONE, ClientIdentity, ClientTokens


def test_a_tokens_file_names_its_clients_and_who_administers():
    tokens = ClientTokens.parse("# who\nalice a-token\n\nroot r-token admin  # ops\n", "clients")
    assert tokens.identify(b"a-token") == ClientIdentity("alice")
    assert tokens.identify(b"r-token") == ClientIdentity("root", admin=True, policy=ADMIN_POLICY)
    assert tokens.identify(b"a-toke") is None and tokens.identify(b"") is None
    assert tokens.holds("r-token") and not tokens.holds("x")
    both = ClientTokens.single("s-token").merged(tokens)
    assert both.identify(b"s-token") is EVERYONE and both.identify(b"a-token").name == "alice"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("alice\n", r"clients, line 1: expected 'NAME TOKEN \[admin\]"),
        ("alice t root\n", "line 1: 'root' is not 'admin' or one of share="),
        ("alice t share=two\n", "line 1: share must be a float, not 'two'"),
        ("alice t share=0\n", "line 1: share must be a positive number"),
        ("alice t max_workers=0\n", "line 1: max_workers must be at least 1"),
        ("alice t\nbob t\n", "line 2: a token given twice"),
        ("alice t\nalice u\n", "each client name has one token"),
        ("# nobody\n", "at least one"),
    ],
)
def test_a_tokens_file_that_is_not_one_is_refused_naming_the_line(text, says):
    with pytest.raises(ValueError, match=says):
        ClientTokens.parse(text, "clients")


def test_a_tokens_file_gives_each_client_its_share_quota_and_priority_ceiling():
    text = "alice a share=2 max_workers=3 max_priority=1\nbob b\nops o admin max_priority=5\n"
    policies = ClientTokens.parse(text, "clients").policies()
    assert policies["alice"] == ClientPolicy(share=2.0, max_workers=3, max_priority=1)
    assert policies["bob"] == ClientPolicy()  # an equal share, no quota, no priority above 0
    assert policies["ops"] == ClientPolicy(max_priority=5)


def test_a_client_sees_its_own_jobs_an_admin_every_job():
    alice = ClientIdentity("alice")
    assert alice.may_see("alice") and not alice.may_see("bob") and not alice.may_see(None)
    assert EVERYONE.may_see("bob") and EVERYONE.may_see(None)
