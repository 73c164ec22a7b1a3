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

#[test]
fn the_readmes_group_example_is_the_compiled_one() {
    // `Group::describe`'s doc example (compiled as a doc test) is the README's, verbatim.
    let docs: String = include_str!("../ibverbs/src/group/mesh.rs")
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("///"))
        .map(|l| format!("{}\n", l.strip_prefix(' ').unwrap_or(l)))
        .collect();
    let start = docs.find("```no_run\nfn main()").expect("Group::describe's example") + "```no_run\n".len();
    let example = &docs[start..start + docs[start..].find("```").unwrap()];
    assert!(example.contains("Group::create"), "{example}");
    for (name, readme) in
        [("README.md", include_str!("../README.md")), ("README.zh-CN.md", include_str!("../README.zh-CN.md"))]
    {
        assert!(
            readme.contains(&format!("```rust\n{example}```")),
            "{name} lacks the group example:\n{example}"
        );
    }
}
