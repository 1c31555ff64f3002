"""Layer 3: the fleet's identities, as data. A device's own key and its certificate request, the
fleet's certificate authority (device and broker certificates, the revocation list), the
enrolment and renewal messages, and the signed trust document of the fleet's signing keys.

Bytes in, bytes out: no file, no connection, no clock of its own (callers pass `now_ms`). The
worker and the leader keep the files and carry the messages; `cryptography` loads only with
these modules, and a worker without `[identity]` never imports them.
"""
