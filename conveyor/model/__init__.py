"""Model code: the only code that touches the device."""
