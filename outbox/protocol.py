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
TOKEN_LENGTH = (16, 4096)  # docs/protocol.md "Webhook bodies" token, 16..4096 characters
MIN_LEGACY_CREDENTIAL_LENGTH = 32  # docs/protocol.md "Legacy credentials" credentials ≥ 32 characters
# A legacy credential goes into a header (Bearer) or keys an HMAC the buyer configured as
# text: visible ASCII only (RFC 9110 field-value characters, no spaces).
LEGACY_CREDENTIAL_RE = re.compile(r"[\x21-\x7e]+")
LEGACY_SCHEMES = {"HMAC-SHA256": "hmac", "Bearer": "bearer"}  # enums/auth-scheme.json
MAX_BODY_BYTES = 1024 * 1024  # receivers SHOULD enforce 1 MB ("Sizes and timeouts")
