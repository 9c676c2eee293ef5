"""The trainer's side of the control plane, one concern a module; ``control.trainer`` composes them."""
