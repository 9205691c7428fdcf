"""The watch session: lifecycle, the step protocol and the drivers that produce it (plain-loop hooks, the distributed coordinator), device placement."""
