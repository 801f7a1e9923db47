"""rich views. Only the CLI imports these; the library never prints."""
