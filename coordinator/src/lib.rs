//! coordinator
