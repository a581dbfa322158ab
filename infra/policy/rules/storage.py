"""The rules on ``gcp:storage/bucket:Bucket``: every bucket private; a recordings bucket (labelled
``infra.names.RECORDINGS_LABEL``) keeps nothing past its retention and nothing after an erase."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from infra.names import RECORDINGS_LABEL
from infra.policy.rules._common import BUCKET, UNKNOWN, _list, _normalize, _q, is_unknown

# --------------------------------------------------------------------------------------------------------
# Rule 13: buckets are private
# --------------------------------------------------------------------------------------------------------


def bucket_private(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A bucket has ``uniformBucketLevelAccess: true`` (IAM alone decides, no object ACL can open one
    object) and ``publicAccessPrevention: "enforced"`` (no grant to ``allUsers`` or ``allAuthenticatedUsers``
    can take effect): the stacks' buckets hold model weights and call recordings, never public content.

    Missing values are violations (the defaults are false and ``inherited``). Each property passes on its
    own when it is unknown during preview.
    """
    if resource_type != BUCKET:
        return []
    p = _normalize(props)
    messages = []
    uniform = p.get("uniformBucketLevelAccess")
    if not is_unknown(uniform) and uniform is not True:
        now = "is not set (default false)" if uniform is None else f"is {_q(uniform)}"
        messages.append(
            f"uniformBucketLevelAccess {now}: object ACLs could open single objects. Set "
            "uniformBucketLevelAccess = true (Python: uniform_bucket_level_access=True)."
        )
    prevention = p.get("publicAccessPrevention")
    if not is_unknown(prevention) and prevention != "enforced":
        now = "is not set (default inherited)" if prevention is None else f"is {_q(prevention)}"
        messages.append(
            f"publicAccessPrevention {now}: a grant to allUsers would make objects public. Set "
            'publicAccessPrevention = "enforced" (Python: public_access_prevention="enforced").'
        )
    return messages


# --------------------------------------------------------------------------------------------------------
# Rule 14: a recordings bucket deletes what is past its retention, and keeps no copy of what is erased
# --------------------------------------------------------------------------------------------------------


def _is_recordings(p: Mapping[str, Any]) -> bool | None:
    """Whether the bucket carries ``RECORDINGS_LABEL``; None when its labels are unknown."""
    labels = p.get("labels")
    if is_unknown(labels):
        return None
    key, value = RECORDINGS_LABEL
    return isinstance(labels, dict) and labels.get(key) == value


def _get(obj: Any, key: str) -> Any:
    """``obj[key]`` of a nested object: UNKNOWN when the object is unknown, None when either is missing."""
    if is_unknown(obj):
        return UNKNOWN
    return obj.get(key) if isinstance(obj, dict) else None


def _age_delete(rule: Any) -> bool | None:
    """Whether a lifecycle rule deletes objects by age (``Delete`` with ``age`` >= 1); None when unknown."""
    if is_unknown(rule):
        return None
    if not isinstance(rule, dict):
        return False
    kind, age = _get(rule.get("action"), "type"), _get(rule.get("condition"), "age")
    if is_unknown(kind) or is_unknown(age):
        return None
    return kind == "Delete" and isinstance(age, int | float) and not isinstance(age, bool) and age >= 1


def recordings_bucket_retention(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """A bucket labelled ``RECORDINGS_LABEL`` has a lifecycle rule that deletes objects by age (``Delete``,
    ``age`` >= 1 day: the backstop of the runtime's retention sweep), no versioning (an erased or expired
    recording would live on as a noncurrent version) and soft delete off
    (``softDeletePolicy.retentionDurationSeconds: 0``; the default keeps deleted objects restorable for 7
    days: cloud.google.com/storage/docs/soft-delete), so an erase on request erases.

    Other buckets pass. Unknown labels, rules or values pass during preview.
    """
    if resource_type != BUCKET:
        return []
    p = _normalize(props)
    if not _is_recordings(p):
        return []
    messages = []
    rules = _list(p.get("lifecycleRules"))
    found = [_age_delete(rule) for rule in rules] if isinstance(rules, list) else [None]
    if True not in found and None not in found:
        messages.append(
            "lifecycleRules has no rule deleting objects by age: recordings past the retention would stay "
            'if the runtime\'s sweep stopped. Add {"action": {"type": "Delete"}, "condition": {"age": '
            "<retention days>}}."
        )
    if _get(p.get("versioning"), "enabled") is True:
        messages.append(
            "versioning.enabled is true: an erased or expired recording would stay as a noncurrent "
            'version. Set versioning = {"enabled": false}.'
        )
    seconds = _get(p.get("softDeletePolicy"), "retentionDurationSeconds")
    if not is_unknown(seconds) and seconds != 0:
        now = "is not set (default 604800 s: 7 days)" if seconds is None else f"is {_q(seconds)}"
        messages.append(
            f"softDeletePolicy.retentionDurationSeconds {now}: erased recordings would stay restorable. Set "
            'softDeletePolicy = {"retentionDurationSeconds": 0} (Python: soft_delete_policy='
            '{"retention_duration_seconds": 0}).'
        )
    return messages
