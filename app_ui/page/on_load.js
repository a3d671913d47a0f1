// Phones: the settings sidebar starts closed (Gradio opens it at any width). Wide screens: the
// message box has the focus (on a phone that would open the keyboard over the page).
() => {
  if (window.innerWidth < 768) {
    const sidebar = document.querySelector('.sidebar.open');
    if (sidebar) sidebar.querySelector('.toggle-button').click();
  } else {
    document.querySelector('#chat-input textarea')?.focus({ preventScroll: true });
  }
}
