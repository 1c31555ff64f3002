"""The artifact format: strict versions, ed25519 keys, the signed manifest, artifact files
(build, sign, verify, inspect) and `make_artifact`, the documented fixture for tests and demos."""
