"""ipywidgets views over dsv41 results (each also renders a static figure headless)."""
