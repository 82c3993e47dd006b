"""The forward: layers, sites, traces, attention, MoE, vision, the model, its sequence state, DSpark."""
