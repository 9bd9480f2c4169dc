"""Online: engines, token trees, verification, the decode loop."""
