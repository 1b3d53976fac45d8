"""Config: the typed schema, the resolvers that build the DeepSpeed config, validation and "auto" filling."""
