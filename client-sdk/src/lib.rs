//! placeholder while reading burn sources
