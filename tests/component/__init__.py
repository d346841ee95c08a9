"""Component tests: a real controller and store, fake agents and clock."""
