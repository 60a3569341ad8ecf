"""Models that draft for a frozen backbone: f_phi and its token-id ablation (SSD), 1D multi-token heads."""
