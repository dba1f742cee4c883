"""DiLoCo: sites that train on their own and meet once a round. The outer loop across sites in one world
(`outer`: round-start weights, pseudo-gradients, the outer Nesterov step, its checkpoint state), and across sites
that drop out and come back, each its own world, on torchft (`ft`). Never imports data."""
