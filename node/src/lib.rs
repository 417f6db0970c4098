//! mlx-node
