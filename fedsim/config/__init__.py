"""The run config: the schema (dataclasses of knobs, a leaf that the trainers read), the YAML dialect and limits."""
