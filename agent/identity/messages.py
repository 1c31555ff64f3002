"""The enrolment and renewal messages, every field bounded.

Enrolment goes over the broker's enrolment listener with the fleet's claim credential, outside
the device topics (`agent.transport.topics.enrol_request` / `enrol_answer`):

    device -> leader   EnrolRequest   its certificate request, hardware identity, agent version
    leader -> device   EnrolAnswer    pending | approved (with the certificate and the CA) | rejected

Renewal goes over the device's own authenticated channel, as an envelope of kind
`identity.renew` on its up topic, answered with a `RenewAnswer` in the reply's body.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from agent.core.config import DeviceName

KIND_RENEW = "identity.renew"
PemText = Annotated[str, msgspec.Meta(max_length=8 * 1024)]
ShortText = Annotated[str, msgspec.Meta(max_length=64)]
Reason = Annotated[str, msgspec.Meta(max_length=512)]
EnrolStatus = Literal["pending", "approved", "rejected"]


class EnrolRequest(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    v: int = 1
    device: DeviceName
    csr: PemText
    serial: ShortText = ""  # the hardware's serial number (a Pi's /proc/cpuinfo Serial)
    machine_id: ShortText = ""  # /etc/machine-id
    agent_version: ShortText = ""
    token: Annotated[str, msgspec.Meta(max_length=128)] = ""  # a batch's enrolment token, if it was given one


class EnrolAnswer(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    v: int = 1
    device: DeviceName
    status: EnrolStatus
    reason: Reason = ""
    cert: PemText = ""
    ca: Annotated[str, msgspec.Meta(max_length=16 * 1024)] = ""


class RenewRequest(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """A renewal: a request for the same device id (the leader checks it against the sender)."""

    device_id: DeviceName
    csr: PemText


class RenewAnswer(msgspec.Struct, kw_only=True, frozen=True):
    cert: PemText


__all__ = ["KIND_RENEW", "EnrolAnswer", "EnrolRequest", "EnrolStatus", "RenewAnswer", "RenewRequest"]
