"""Grid-friendly power: a receding-horizon plan, and what the shape laws measured.

The ramp and floor laws themselves are the controller's (powerbatch.control.laws.ramp).
"""
