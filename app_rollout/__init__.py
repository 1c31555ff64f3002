"""The application kind: a signed bundle of a service (its files and its systemd unit) that a
device installs beside the running version, starts, checks, and keeps or takes back.

    bundle      the `.eaapp` file: a signed manifest naming every file, the unit and the health check
    unit        what a bundle's unit may ask for, and the unit the device runs (sandboxed, its own user)
    kind        APP, AppKind: the kind on the leader (admit, offer)
    messages    AppOffer
    device/     the worker's side (fetch, the offer module) and the root application helper
"""
