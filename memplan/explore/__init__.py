"""Views over many estimates: sweeps of batch size and comparisons of techniques."""
