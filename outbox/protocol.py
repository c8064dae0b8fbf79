"""AdCP protocol constants for webhook bodies (docs/protocol.md, "Webhook bodies").

A spec change is an edit here and nowhere else.
"""

from __future__ import annotations

import re

# Task-type enum: the spec's main list plus the SDK 3.2.4 additions (the newer wire contract).
TASK_TYPES = frozenset(
    """
    create_media_buy update_media_buy buy_products accept_proposal control_media_buy media_buy_delivery
    sync_creatives build_creative preview_creative activate_signal get_products request_proposals
    refine_proposals decline_proposals get_signals create_property_list update_property_list
    get_property_list list_property_lists delete_property_list sync_accounts get_account_financials
    get_creative_delivery sync_event_sources sync_audiences sync_catalogs log_event get_brand_identity
    search_brands get_rights acquire_rights update_rights sync_agent_notification_configs
    get_creative_features sync_principal get_principal sync_reporting_status sync_reporting_receipts
    """.split()
)
# docs/protocol.md "Webhook bodies" task-status enum.
TASK_STATUSES = frozenset(
    "submitted working input-required completed canceled failed rejected auth-required unknown".split()
)
# docs/protocol.md "Webhook bodies": the SDK's default notification_id "<task_id>.terminal" applies to these.
TERMINAL_STATUSES = frozenset({"completed", "failed", "canceled", "rejected"})
# docs/protocol.md "Delivery reports": delivery-report notification types.
DELIVERY_NOTIFICATION_TYPES = frozenset({"scheduled", "final", "delayed", "adjusted", "window_update"})
DELIVERY_TASK_TYPE = "media_buy_delivery"

IDEMPOTENCY_KEY_RE = re.compile(r"^[A-Za-z0-9_.:-]{16,255}$")  # idempotency_key pattern
OPERATION_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,255}$")  # push-notification-config
NOTIFICATION_ID_RE = OPERATION_ID_RE  # docs/protocol.md "Webhook bodies" notification_id has the same pattern
MAX_ID_BYTES = 255  # tenant, account, media buy, task, principal ids: AdCP's maxLength, counted in UTF-8 bytes
TOKEN_LENGTH = (16, 4096)  # docs/protocol.md "Webhook bodies" token, 16..4096 characters
MIN_LEGACY_CREDENTIAL_LENGTH = 32  # docs/protocol.md "Legacy credentials" credentials ≥ 32 characters
# A legacy credential goes into a header (Bearer) or keys an HMAC the buyer configured as
# text: visible ASCII only (RFC 9110 field-value characters, no spaces).
LEGACY_CREDENTIAL_RE = re.compile(r"[\x21-\x7e]+")
LEGACY_SCHEMES = {"HMAC-SHA256": "hmac", "Bearer": "bearer"}  # enums/auth-scheme.json
MAX_BODY_BYTES = 1024 * 1024  # receivers SHOULD enforce 1 MB ("Sizes and timeouts")

# Account-level notification channels, from the AdCP 3.2 schemas
# (https://adcontextprotocol.org/schemas/3.2.4/core/notification-config.json and
# .../enums/notification-type.json): what a notification_configs[] entry may subscribe to,
# and every notification type a webhook_activity[] record may carry.
ACCOUNT_EVENT_TYPES = frozenset(
    """
    creative.status_changed creative.assignment_changed indicators.changed creative.purged
    account.status_changed account.change_recorded product.created product.updated product.priced
    product.removed signal.created signal.updated signal.priced signal.removed wholesale_feed.bulk_change
    reporting.delivery_ready reporting.status_changed reporting.ledger_changed
    """.split()
)
# Account-anchored types that belong to one buyer principal (the reporting consumer): they
# fan out only to that principal's subscribers, never to every subscriber of a shared account.
PRINCIPAL_SCOPED_TYPES = frozenset({"reporting.delivery_ready", "reporting.status_changed", "reporting.ledger_changed"})
NOTIFICATION_TYPES = ACCOUNT_EVENT_TYPES | DELIVERY_NOTIFICATION_TYPES | {
    "impairment", "capabilities.changed", "principal.changed"}
SUBSCRIBER_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # notification-config.json subscriber_id
NOTIFICATION_CONFIG_KEYS = frozenset(
    {"subscriber_id", "url", "event_types", "product_payload_view", "authentication", "active", "ext"})
# webhook-challenge.json: the proof-of-control POST, and the receiver's echo fields
# (webhook-challenge-response.json).
CHALLENGE_TYPE = "webhook.challenge"
CHALLENGE_RE = re.compile(r"^[A-Za-z0-9_.:-]{32,255}$")
CHALLENGE_ECHO_FIELDS = ("challenge", "token")
DELIVERY_AUTH_MODES = {"rfc9421": "rfc9421", "hmac": "HMAC-SHA256", "bearer": "Bearer"}
# core/version-envelope.json ``adcp_version`` (release precision, optional pre-release) of AdCP 3.0.
ADCP_3_0_RE = re.compile(r"3\.0(?:-[a-zA-Z0-9](?:[a-zA-Z0-9.-]*[a-zA-Z0-9])?)?")


def requires_operation_id(adcp_version: str | None) -> bool:
    """Whether a task's webhook registration must carry ``operation_id`` (docs/protocol.md,
    "Webhook bodies"): always, unless the task's request was served as AdCP 3.0 (``"3.0"``,
    the SDK's ``resolved_adcp_version``), whose ``push_notification_config`` has no such
    member; such a buyer's webhooks then carry none."""
    return adcp_version is None or ADCP_3_0_RE.fullmatch(adcp_version) is None
