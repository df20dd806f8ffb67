"""What a setting's value must be, for the checks that name a bad one."""


def is_int(x) -> bool:
    """An int, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """An int or float, not a bool, not NaN."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
