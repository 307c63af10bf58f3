"""The staleness rule and the token-staleness mask, in their one module (rlcli.produce.staleness)."""

from rlcli.produce.staleness import StalenessRule, mask_stale_tokens, seq_staleness
from rlcli.types import Group, Sample, Status


def test_thresholds_from_sync_windows():
    # (bound + 1) * sync_weights_interval, in policy versions
    assert StalenessRule.from_windows(4, retryable=False) == StalenessRule(4, None, retryable=False)
    assert StalenessRule.from_windows(3, 2, 0, retryable=True) == StalenessRule(9, 3, retryable=True)


def test_one_rule_for_samples_and_the_producer_lead():
    rule = StalenessRule(4)
    assert [rule.expired(s) for s in (3, 4)] == [False, True]
    # data for step 8 made by policy 4 has staleness 3: fine; step 9 would be born expired
    assert seq_staleness(4, 8) == 3 and not rule.model_expired(8, 4) and rule.model_expired(9, 4)
    assert not StalenessRule(None).model_expired(100, 0)


def test_mask_stale_tokens_writes_completed_samples_and_counts_new_zeros():
    done = Sample(uid=0, group_id=0, task_name="t", prompt_ids=[1], response_ids=[5, 6, 7],
                  response_mask=[0, 1, 1], token_versions=[0, 0, 4], status=Status.COMPLETED)
    paused = Sample(uid=1, group_id=0, task_name="t", prompt_ids=[1], response_ids=[5],
                    token_versions=[0], status=Status.ABORTED)
    g = Group(0, "t", [done, paused])
    assert mask_stale_tokens([g], 5, None) == 0 and done.response_mask == [0, 1, 1]
    assert mask_stale_tokens([g], 5, 4) == 1  # token 0 was already masked, token 1 is new
    assert done.response_mask == [0, 0, 1] and paused.response_mask == []
