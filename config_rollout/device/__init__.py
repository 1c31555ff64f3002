"""The device's side of configuration rollouts: a release applied to a target, commit-confirmed
(`config_rollout.device.apply`)."""
