"""The release of a device's whole desired state: one signed document naming a firmware, config
releases and applications with their versions, and the order a device converges in; rolled out
by the engine like any kind, applied on a device all or nothing (`docs/releases.md`)."""
