"""Layer 0: clock, ids, wire codec, typed errors and config. Imports nothing above it."""
