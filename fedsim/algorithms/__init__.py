"""The built-in methods, one module each. The registry imports them when a config first names an algorithm."""
