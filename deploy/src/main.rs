//! `tether-render DIR`: prints what a kustomization directory renders to
//! (the subset of kustomize Tether's overlays use; see `tether_deploy`).

fn main() -> anyhow::Result<()> {
    let Some(dir) = std::env::args().nth(1) else {
        anyhow::bail!("usage: tether-render deploy/overlays/prod");
    };
    let objects = tether_deploy::render(std::path::Path::new(&dir))?;
    print!("{}", tether_deploy::to_yaml(&objects)?);
    Ok(())
}
