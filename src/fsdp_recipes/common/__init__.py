"""Layer 0: what every other layer uses: errors and the error boundary, output folders, fault injection, tables, YAML/JSON files."""
