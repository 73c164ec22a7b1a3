//! Host test: the README's quick start is `examples/quickstart.rs`, verbatim.

#[test]
fn readme_quick_start_is_the_quickstart_example() {
    let readme = include_str!("../README.md");
    let example = include_str!("../examples/quickstart.rs");
    assert!(
        readme.contains(&format!("```rust\n{example}```")),
        "README quick start differs from examples/quickstart.rs"
    );
    assert!(readme.contains("cargo xtask demo"));
    assert!(readme.contains("cargo xtask test"));
}
